"""Decoding a clip, its quality statistics and whether it holds speech."""
