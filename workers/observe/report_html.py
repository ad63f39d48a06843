"""`voxmill report OUT [--html FILE]`: what a finished run did, as text or one self-contained page.

`render_html(ReportData)` draws from plain data (no files): histograms of duration and speech
ratio, utterances per speaker (the failed ones in red, so a speaker whose every clip failed has
its bar), failures by code, the first failures with their reason and a link to `errors.jsonl`,
audio done over the run's time, the models and a summary. The charts are inline SVG written
here; the page loads nothing (no script, font or style from elsewhere), so it opens the same
offline, from a mail attachment or a CI artefact. Its one inline script only stamps each chart's
laid-out box (`data-box="x,y,w,h"`) on it, for the test that screenshots the page.
`render_text(ReportData)` says the same in lines for a terminal (no charts).

`load_report_data(out_dir)` reads that data from an output folder: `report.json`,
`errors.jsonl`, `utt_stats.parquet` (every utterance's speaker), and the shard files
(`shards/*.parquet`: the stats columns, and each file's time and audio seconds for the
throughput curve).
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pipeline.outputs.folder import RunFolder
from pipeline.outputs.report import RunReport

WIDTH, HEIGHT = 540, 300
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 56, 16, 34, 46
BAR = "#2f6fdf"
BAR_FAILED = "#d9534f"
LINES = ("#1b9e77", "#7570b3", "#e7298a", "#66a61e")
AXIS = "#555555"
GRID = "#e4e4e4"
MAX_BARS = 30  # speakers and codes beyond this are summed into one "N more" bar
HISTOGRAM_BINS = 24
FIRST_FAILURES = 10  # failures listed on the page and in the text, with a link to all of them
FAILURE_FIELDS = ("utt", "op", "code", "message")


@dataclass
class ReportData:
    """Everything the page shows, as plain values.

    `utts_per_speaker`: every utterance, `failed_per_speaker` those with a failure (or left
    out by a filter) in `errors.jsonl`; `first_failures`: its first lines (`utt`, `op`, `code`,
    `message`), of `failure_rows` in all, at `errors_href` (relative to the page).
    `progress`: per op, (seconds since the run started, audio seconds that op finished by then),
    in time order.
    `summary`: report.json's counts (`utterances`, `audio_seconds`, `wall_seconds`, `ops`,
    `remerge_wall_seconds` after a re-merge with other filters).
    """

    title: str = "voxmill run"
    durations_s: list[float] = field(default_factory=list)
    speech_ratios: list[float] = field(default_factory=list)
    utts_per_speaker: dict[str, int] = field(default_factory=dict)
    failed_per_speaker: dict[str, int] = field(default_factory=dict)
    failures_by_code: dict[str, int] = field(default_factory=dict)
    first_failures: list[dict[str, str]] = field(default_factory=list)
    failure_rows: int = 0
    errors_href: str = RunFolder.ERRORS
    progress: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    models: dict[str, dict[str, str]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- SVG charts


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _nice_max(value: float) -> float:
    """The smallest round number at or above `value` (an axis top): 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    steps = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10)
    return float(next(step * power for step in steps if step * power >= value * (1 - 1e-9)))


def _fmt(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 1000 or value == int(value) else f"{value:.3g}"


def _frame(chart_id: str, title: str, body: list[str], y_top: float, y_label: str, x_label: str) -> str:
    """An SVG chart: title, horizontal grid lines with y ticks, axes, axis labels, then `body`."""
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    parts = [
        f'<svg class="chart" id="{chart_id}" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg" role="img">',
        f"<title>{_esc(title)}</title>",
        f'<text x="{MARGIN_LEFT}" y="20" class="title">{_esc(title)}</text>',
    ]
    for step in range(5):
        value = y_top * step / 4
        y = MARGIN_TOP + plot_h - plot_h * step / 4
        parts.append(
            f'<line x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="{GRID}"/>'
        )
        parts.append(
            f'<text x="{MARGIN_LEFT - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt(value)}</text>'
        )
    parts += body
    bottom = MARGIN_TOP + plot_h
    parts += [
        f'<line x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" y1="{bottom}" y2="{bottom}" stroke="{AXIS}"/>',
        f'<line x1="{MARGIN_LEFT}" x2="{MARGIN_LEFT}" y1="{MARGIN_TOP}" y2="{bottom}" stroke="{AXIS}"/>',
        f'<text x="{(MARGIN_LEFT + WIDTH - MARGIN_RIGHT) / 2}" y="{HEIGHT - 6}" class="label" '
        f'text-anchor="middle">{_esc(x_label)}</text>',
        f'<text x="14" y="{MARGIN_TOP + plot_h / 2}" class="label" text-anchor="middle" '
        f'transform="rotate(-90 14 {MARGIN_TOP + plot_h / 2})">{_esc(y_label)}</text>',
        "</svg>",
    ]
    return "\n".join(parts)


def _empty(chart_id: str, title: str, why: str) -> str:
    return (
        f'<svg class="chart empty" id="{chart_id}" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg" role="img">'
        f"<title>{_esc(title)}</title>"
        f'<text x="{MARGIN_LEFT}" y="20" class="title">{_esc(title)}</text>'
        f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" class="label" text-anchor="middle">{_esc(why)}</text></svg>'
    )


def _x_ticks(low: float, span: float) -> list[str]:
    """Five labels under the x axis, from `low` to `low + span`."""
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    return [
        f'<text x="{MARGIN_LEFT + plot_w * step / 4:.1f}" y="{HEIGHT - MARGIN_BOTTOM + 16}" class="tick" '
        f'text-anchor="middle">{_fmt(low + span * step / 4)}</text>'
        for step in range(5)
    ]


def _bars(
    bars: list[tuple[str, int]],
    top: float,
    color: str,
    fill: float,
    below: list[int] | None = None,
    kind: str = "bar",
) -> list[str]:
    """One bar per (tooltip, count), side by side across the plot, each `fill` of its slot wide;
    with `below`, each bar stands on that many (a stacked part). Empty bars are left out."""
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    width = plot_w / len(bars)
    out = []
    for index, (tip, count) in enumerate(bars):
        if below is not None and count == 0:
            continue
        h = plot_h * count / top
        base = MARGIN_TOP + plot_h - (plot_h * below[index] / top if below is not None else 0.0)
        x = MARGIN_LEFT + index * width + width * (1 - fill) / 2
        out.append(
            f'<rect class="{kind}" x="{x:.1f}" y="{base - h:.1f}" '
            f'width="{max(width * fill, 1):.1f}" height="{h:.1f}" fill="{color}">'
            f"<title>{_esc(tip)}: {count}</title></rect>"
        )
    return out


def histogram(
    chart_id: str, title: str, values: list[float], x_label: str, low: float, high: float, bins: int
) -> str:
    """A histogram of `values` over [low, high] in `bins` equal bins (values outside are clamped)."""
    if not values:
        return _empty(chart_id, title, "no values in this run")
    span = (high - low) or 1.0
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, max(0, int((value - low) / span * bins)))] += 1
    top = _nice_max(max(counts))
    edges = [low + span * index / bins for index in range(bins + 1)]
    tips = [(f"{edges[i]:.3g}–{edges[i + 1]:.3g}", count) for i, count in enumerate(counts)]
    body = _bars(tips, top, BAR, 0.92) + _x_ticks(low, span)
    return _frame(chart_id, title, body, top, "utterances", x_label)


def bar_chart(
    chart_id: str,
    title: str,
    counts: dict[str, int],
    x_label: str,
    color: str = BAR,
    failed: dict[str, int] | None = None,
) -> str:
    """One bar per label (largest first; beyond `MAX_BARS`, one bar for the rest), labels when few.

    `failed`: how many of each label's count failed, drawn in `BAR_FAILED` on top of the rest.
    """
    if not counts:
        return _empty(chart_id, title, "none in this run")
    failed = failed or {}
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    bad = [failed.get(label, 0) for label, _ in ranked]
    if len(ranked) > MAX_BARS:
        rest = ranked[MAX_BARS - 1 :]
        ranked = [*ranked[: MAX_BARS - 1], (f"{len(rest)} more", sum(n for _, n in rest))]
        bad = [*bad[: MAX_BARS - 1], sum(bad[MAX_BARS - 1 :])]
    top = _nice_max(max(n for _, n in ranked))
    ok = " ok" if any(bad) else ""
    body = _bars([(label + ok, n - b) for (label, n), b in zip(ranked, bad, strict=True)], top, color, 0.8)
    if any(bad):  # each failed part stands on its label's bar
        body += _bars(
            [(f"{label} failed", b) for (label, _), b in zip(ranked, bad, strict=True)],
            top,
            BAR_FAILED,
            0.8,
            below=[n - b for (_, n), b in zip(ranked, bad, strict=True)],
            kind="bar failed",
        )
        body.append(  # the legend, beside the title: above the plot, never over a bar
            f'<rect x="{WIDTH - MARGIN_RIGHT - 60}" y="11" width="12" height="10" '
            f'fill="{BAR_FAILED}"/><text x="{WIDTH - MARGIN_RIGHT - 44}" y="20" class="label">failed</text>'
        )
    slot = (WIDTH - MARGIN_LEFT - MARGIN_RIGHT) / len(ranked)
    if len(ranked) <= 12:
        for index, (label, _) in enumerate(ranked):
            short = label if len(label) <= 12 else label[:11] + "…"
            body.append(
                f'<text x="{MARGIN_LEFT + slot * (index + 0.5):.1f}" y="{HEIGHT - MARGIN_BOTTOM + 16}" '
                f'class="tick" text-anchor="middle">{_esc(short)}</text>'
            )
    return _frame(chart_id, title, body, top, "utterances", x_label)


def line_chart(
    chart_id: str, title: str, series: dict[str, list[tuple[float, float]]], x_label: str, y_label: str
) -> str:
    """One line per series through its (x, y) points from the origin, a dot at each point, a legend."""
    series = {name: points for name, points in series.items() if points}
    if not series:
        return _empty(chart_id, title, "no shard timings in this run")
    x_top = _nice_max(max(x for points in series.values() for x, _ in points))
    y_top = _nice_max(max(y for points in series.values() for _, y in points))
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def at(x: float, y: float) -> tuple[float, float]:
        return MARGIN_LEFT + plot_w * x / x_top, MARGIN_TOP + plot_h - plot_h * y / y_top

    body = []
    for index, (name, points) in enumerate(sorted(series.items())):
        color = LINES[index % len(LINES)]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in (at(x, y) for x, y in [(0.0, 0.0), *points]))
        body.append(f'<polyline class="line" points="{path}" fill="none" stroke="{color}" stroke-width="3"/>')
        body += [
            f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>'
            for px, py in (at(x, y) for x, y in points)
        ]
        legend_y = MARGIN_TOP + 14 + 16 * index
        body.append(
            f'<rect x="{MARGIN_LEFT + 10}" y="{legend_y - 9}" width="12" height="10" fill="{color}"/>'
            f'<text x="{MARGIN_LEFT + 28}" y="{legend_y}" class="label">{_esc(name)}</text>'
        )
    body += _x_ticks(0.0, x_top)
    return _frame(chart_id, title, body, y_top, y_label, x_label)


# --------------------------------------------------------------------------- the page

STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; background: #ffffff; }
h1 { font-size: 22px; margin: 0 0 8px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; }
code { font-size: 12px; }
.charts { display: grid; grid-template-columns: repeat(2, 540px); gap: 20px; }
.chart .title { font-size: 14px; font-weight: bold; }
.chart .tick { font-size: 11px; fill: #555; }
.chart .label { font-size: 12px; fill: #333; }
"""
# Stamps each chart's laid-out box on it (for the screenshot test); the page needs nothing else.
BOX_SCRIPT = """
for (const chart of document.querySelectorAll("svg.chart")) {
  const r = chart.getBoundingClientRect();
  chart.setAttribute("data-box", [r.left, r.top, r.width, r.height].map(Math.round).join(","));
}
"""


def summary_rows(data: ReportData) -> list[tuple[str, str]]:
    """(what, value) of a run's summary: counts, audio, the extraction's wall time and speed."""
    summary = data.summary
    audio = float(summary.get("audio_seconds") or 0.0)
    wall = float(summary.get("wall_seconds") or 0.0)
    rows = [
        ("utterances", str(summary.get("utterances", len(data.durations_s)))),
        ("audio", f"{audio / 3600:.2f} h ({audio:.1f} s)"),
        ("wall time", f"{wall:.1f} s"),
        ("speed", f"{audio / wall:.1f}x real time" if wall > 0 else "n/a"),
    ]
    if summary.get("remerge_wall_seconds") is not None:  # the wall time and speed above: the extraction's
        rows.append(("filters applied anew", f"in {float(summary['remerge_wall_seconds']):.1f} s"))
    for op, counts in sorted((summary.get("ops") or {}).items()):
        rows.append((f"op {op}", f"{counts.get('ok', 0)} ok, {counts.get('failed', 0)} failed"))
    return rows


def _summary_table(data: ReportData) -> str:
    rows = summary_rows(data)
    cells = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    models = "".join(
        f"<tr><td>{_esc(role)}</td><td>{_esc(ref.get('file', ''))}</td>"
        f"<td><code>{_esc(ref.get('sha256', ''))}</code></td></tr>"
        for role, ref in sorted(data.models.items())
    )
    model_table = (
        f"<table><tr><th>role</th><th>file</th><th>sha256</th></tr>{models}</table>" if models else ""
    )
    return f"<table>{cells}</table>{model_table}"


def render_html(data: ReportData) -> str:
    """The whole page, self-contained (module docstring)."""
    longest = max(data.durations_s, default=0.0)
    charts = [
        histogram(
            "durations", "Duration", data.durations_s, "seconds", 0.0, _nice_max(longest), HISTOGRAM_BINS
        ),
        histogram(
            "speech-ratio",
            "Speech ratio",
            data.speech_ratios,
            "share of the clip that is speech",
            0.0,
            1.0,
            20,
        ),
        bar_chart(
            "speakers",
            "Utterances per speaker",
            data.utts_per_speaker,
            "speaker",
            failed=data.failed_per_speaker,
        ),
        bar_chart("failures", "Failures by code", data.failures_by_code, "error code", BAR_FAILED),
        line_chart("throughput", "Audio done over the run, per op", data.progress, "wall seconds", "audio s"),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_esc(data.title)}</title><style>{STYLE}</style></head><body>\n"
        f"<h1>{_esc(data.title)}</h1>\n{_summary_table(data)}\n"
        f'<div class="charts">\n' + "\n".join(charts) + "\n</div>\n"
        f"{_failures_table(data)}\n"
        f"<script>{BOX_SCRIPT}</script>\n</body></html>\n"
    )


def _failures_table(data: ReportData) -> str:
    """The first failures (utterance, op, code, why) and a link to all of them."""
    link = f'<a href="{_esc(data.errors_href)}">errors.jsonl</a>'
    if not data.first_failures:
        return f'<h2>Failures</h2><p id="failures-list">none: {link} is empty</p>'
    rows = "".join(
        f"<tr><td>{_esc(f.get('utt', ''))}</td><td>{_esc(f.get('op', ''))}</td>"
        f"<td><code>{_esc(f.get('code', ''))}</code></td><td>{_esc(f.get('message', ''))}</td></tr>"
        for f in data.first_failures
    )
    return (
        f"<h2>Failures</h2><p>{_failures_heading(data, link)}:</p>"
        f'<table id="failures-list"><tr><th>utterance</th><th>op</th><th>code</th><th>why</th></tr>'
        f"{rows}</table>"
    )


def _failures_heading(data: ReportData, where: str) -> str:
    """How many failure rows there are, where all of them are, and how many follow."""
    shown = len(data.first_failures)
    if shown < data.failure_rows:
        return f"{data.failure_rows} failure(s) (utterance and op) in {where}; the first {shown}"
    return f"{data.failure_rows} failure(s) (utterance and op), from {where}"


def render_text(data: ReportData, errors_path: str = RunFolder.ERRORS) -> str:
    """The run's summary for a terminal: what the page says, without its charts."""
    lines = [data.title]
    lines += [f"  {what:<22}{value}" for what, value in summary_rows(data)]
    for role, ref in sorted(data.models.items()):
        sha256 = str(ref.get("sha256", ""))[:12]
        lines.append(f"  {'model ' + role:<22}{ref.get('file', '')} (sha256 {sha256}…)")
    if data.durations_s:
        ordered = sorted(data.durations_s)
        median = ordered[len(ordered) // 2]
        lines.append(f"  {'duration':<22}{ordered[0]:.2f}-{ordered[-1]:.2f} s, median {median:.2f} s")
    speakers = len(data.utts_per_speaker)
    failed = data.failed_per_speaker
    all_failed = sorted(s for s, n in data.utts_per_speaker.items() if n and failed.get(s) == n)
    said = f"{speakers}" + (f"; every utterance failed for {', '.join(all_failed)}" if all_failed else "")
    lines.append(f"  {'speakers':<22}{said}")
    if not data.first_failures:
        lines.append(f"  {'failures':<22}none ({errors_path} is empty)")
        return "\n".join(lines)
    by_code = sorted(data.failures_by_code.items(), key=lambda kv: (-kv[1], kv[0]))
    codes = ", ".join(f"{code} {n}" for code, n in by_code)
    lines.append(f"  {'failed utterances':<22}{sum(data.failures_by_code.values())} by code: {codes}")
    lines.append(_failures_heading(data, errors_path) + ":")
    for failure in data.first_failures:
        lines.append(
            f"  {failure.get('utt', '')}  {failure.get('op', '')}  {failure.get('code', '')}: "
            f"{failure.get('message', '')}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- reading a run


def load_report_data(out_dir: Path) -> ReportData:
    """The page's data from an output folder (module docstring); missing files leave parts empty."""
    out_dir = Path(out_dir)
    found = _read_json(out_dir / RunFolder.REPORT)
    report = RunReport.from_dict(found) if found else None
    data = ReportData(title=f"voxmill run: {out_dir.resolve().name}")
    if report is not None:
        data.models = {role: ref.to_dict() for role, ref in report.models.items()}
        data.summary = {
            "utterances": report.utterances,
            "audio_seconds": report.audio_seconds,
            "wall_seconds": report.wall_seconds,
            "ops": {op: counts.to_dict() for op, counts in report.ops.items()},
            "remerge_wall_seconds": report.remerge_wall_seconds,
        }
    failed_utts = _read_failures(out_dir / RunFolder.ERRORS, data)
    stats, speakers, done = _read_shards(sorted((out_dir / RunFolder.SHARDS).glob("*.parquet")))
    data.durations_s = [d for d, _ in stats.values() if d is not None]
    data.speech_ratios = [r for _, r in stats.values() if r is not None]
    utt_stats = out_dir / RunFolder.UTT_STATS
    if utt_stats.exists():  # every utterance of the run, failed ones too, with its speaker
        import pyarrow.parquet as pq

        columns = pq.read_table(utt_stats, columns=["utt", "spk"]).to_pydict()
        speakers = dict(zip(columns["utt"], columns["spk"], strict=True))
    for utt, spk in speakers.items():
        name = spk or "(none)"
        data.utts_per_speaker[name] = data.utts_per_speaker.get(name, 0) + 1
        if utt in failed_utts:
            data.failed_per_speaker[name] = data.failed_per_speaker.get(name, 0) + 1
    data.progress = _progress(done, out_dir / RunFolder.REPORT, report.wall_seconds if report else None)
    return data


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _read_failures(path: Path, data: ReportData) -> set[str]:
    """Fill `data`'s failures from errors.jsonl (utterances per code, an utterance failing in two
    ops with one code counted once; its first rows; how many); the utterances that failed."""
    seen: set[tuple[str, str]] = set()
    try:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                if not line.strip():
                    continue
                record = json.loads(line)
                seen.add((str(record.get("utt")), str(record.get("code"))))
                data.failure_rows += 1
                if len(data.first_failures) < FIRST_FAILURES:
                    data.first_failures.append({k: str(record.get(k, "")) for k in FAILURE_FIELDS})
    except OSError:
        return set()
    for _, code in seen:
        data.failures_by_code[code] = data.failures_by_code.get(code, 0) + 1
    return {utt for utt, _ in seen}


def _read_shards(
    paths: list[Path],
) -> tuple[dict[str, tuple[float | None, float | None]], dict[str, str], list[tuple[str, float, float]]]:
    """Per utt (duration, speech ratio) and speaker; per shard file (op, its time, audio seconds)."""
    import pyarrow.parquet as pq

    stats: dict[str, tuple[float | None, float | None]] = {}
    speakers: dict[str, str] = {}
    done: list[tuple[str, float, float]] = []
    for path in paths:
        try:
            table = pq.read_table(path)
            written = path.stat().st_mtime
        except OSError:
            continue
        names = table.column_names
        columns = table.to_pydict()
        durations = columns.get("duration_s") or [None] * table.num_rows
        ratios = columns.get("speech_ratio") or [None] * table.num_rows
        for utt, spk, duration, ratio in zip(columns["utt"], columns["spk"], durations, ratios, strict=True):
            speakers.setdefault(utt, spk)
            known = stats.get(utt, (None, None))
            stats[utt] = (
                known[0] if known[0] is not None else duration,
                known[1] if known[1] is not None else ratio,
            )
        seconds = (
            sum(s for s in columns.get("audio_seconds", []) if s is not None)
            if "audio_seconds" in names
            else 0.0
        )
        done.append((path.stem.rsplit("-", 1)[0], written, float(seconds)))
    return stats, speakers, done


def _progress(
    done: list[tuple[str, float, float]], report_path: Path, wall: float | None
) -> dict[str, list[tuple[float, float]]]:
    """Per op, (seconds since the start, cumulative audio seconds) at each shard file, in time order.

    The start is report.json's time less the run's wall seconds (the merge writes it last), or
    the first shard file's time when that is earlier (a resumed run).
    """
    if not done:
        return {}
    start = min(written for _, written, _ in done)
    if wall and report_path.exists():
        start = min(start, report_path.stat().st_mtime - float(wall))
    series: dict[str, list[tuple[float, float]]] = {}
    totals: dict[str, float] = {}
    for op, written, seconds in sorted(done, key=lambda d: d[1]):
        totals[op] = totals.get(op, 0.0) + seconds
        series.setdefault(op, []).append((round(written - start, 3), round(totals[op], 3)))
    return series


def write_report(out_dir: Path, html_file: Path) -> Path:
    """`voxmill report OUT --html FILE`: load the run's data, render, write (atomically). The page
    links to OUT/errors.jsonl relative to where it is written."""
    import os

    from pipeline.outputs.writers import write_text

    data = load_report_data(Path(out_dir))
    errors = Path(out_dir).resolve() / RunFolder.ERRORS
    data.errors_href = quote(Path(os.path.relpath(errors, Path(html_file).resolve().parent)).as_posix())
    write_text(Path(html_file), render_html(data))
    return Path(html_file)
