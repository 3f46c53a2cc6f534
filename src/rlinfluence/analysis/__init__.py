"""Analyses on top of attribution: per-record tables, diagnosis, formation timeline, intervention."""
