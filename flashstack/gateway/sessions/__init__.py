"""Stateful sessions: a store (SQLite or PostgreSQL), per-session turns, and their endpoints.

db.py (engines, tables, migrations) · store.py (SQL) · turns.py (locks, commits) ·
hooks.py (what chat.py calls) · api.py (the /v1/sessions and /v1/keys endpoints).
"""
