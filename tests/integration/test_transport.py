"""The broker transport survives the state kombu leaves after a broker outage (workers/queue/transport.py).

On a real Redis: a channel holding an unacknowledged message is closed after the transport forgot
its broker URL, as happens when Celery closes a connection that Redis dropped. Stock kombu raises
AttributeError there (a worker-killing "unrecoverable error"); voxmill's transport puts the
message back on its queue.
"""

from __future__ import annotations

import redis
from kombu import Connection, Exchange, Queue
from kombu.transport import redis as kombu_redis

from workers.queue import transport
from workers.queue.transport import Channel

transport.register()  # what `create_app` does


def test_broker_urls_use_voxmills_transport(redis_url: str) -> None:
    with Connection(redis_url) as connection:
        assert isinstance(connection.default_channel, Channel)
    with Connection(redis_url.replace("redis://", "rediss://")) as connection:
        assert connection.transport_cls == "rediss"
        assert issubclass(connection.get_transport_cls(), kombu_redis.Transport)
        assert connection.get_transport_cls().Channel is Channel


def test_unacked_message_is_restored_after_the_transport_forgot_its_url(
    redis_url: str, redis_client: redis.Redis
) -> None:
    queue = Queue("voxmill-transport-test", Exchange("voxmill-transport-test", type="direct"), "t")
    connection = Connection(redis_url)
    channel = connection.default_channel
    bound = queue(channel)
    bound.declare()
    connection.Producer(channel).publish({"job": 1}, exchange=queue.exchange, routing_key="t")
    message = bound.get(no_ack=False)
    assert message is not None and message.payload == {"job": 1}
    assert redis_client.llen(queue.name) == 0  # delivered, not acknowledged
    connection.transport.client = None  # what kombu's close leaves behind
    channel.close()  # stock kombu: AttributeError: 'NoneType' object has no attribute 'hostname'
    assert redis_client.llen(queue.name) == 1
    with Connection(redis_url) as fresh:
        again = queue(fresh.default_channel).get(no_ack=True)
    assert again is not None and again.payload == {"job": 1}
