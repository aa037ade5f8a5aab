"""The session log's rows in the embedded store: one session's batch written inside the caller's
transaction. A module of its own because the log's bookkeeping (replace by key, totals kept in
`log_meta`, retention trimmed from the oldest seq) is a job apart from the key/value store around
it (uibus.infra.sqlite_store, which opens the transaction, one for many sessions' batches)."""

from __future__ import annotations

import sqlite3

from uibus.infra.store import LogEntry, LogRetention

_LOG_META = ("SELECT floor, count, bytes, (SELECT at FROM log WHERE session=?1 ORDER BY seq LIMIT 1) "
             "FROM log_meta WHERE session=?1")
# INDEXED BY: without statistics SQLite would scan the session's rows by seq
_LOG_OLD_ONE = "SELECT seq, length(data) FROM log INDEXED BY log_by_key WHERE session=? AND kind=? AND key=?"
_LOG_INSERT = "INSERT OR REPLACE INTO log(session, seq, kind, key, epoch, at, data) VALUES (?, ?, ?, ?, ?, ?, ?)"


def append_batch(db: sqlite3.Connection, session: str, entries: list[LogEntry], keep: LogRetention,
                 now: float) -> bool:
    """One session's batch inside the caller's transaction; whether it made the session's row."""
    # the totals and the oldest entry's time in one statement (a host's final message commits alone)
    meta = db.execute(_LOG_META, (session,)).fetchone()
    floor, count, size, oldest = meta if meta is not None else (0, 0, 0, None)
    newest = {(e.kind, e.key): e for e in entries}  # within the batch too, the last state wins
    by_kind: dict[str, list[str]] = {}
    rows = []
    first, last = float("inf"), float("-inf")  # the batch's earliest and latest event
    for (kind, key), e in newest.items():
        if not e.new:  # a key just made (a host request's id) has no row to replace
            by_kind.setdefault(kind, []).append(key)
        # a bytearray binds as the same BLOB, without sqlite3's failed look-up of an adapter for bytes
        rows.append((session, e.seq, kind, key, e.epoch, e.at, bytearray(e.data)))
        size += len(e.data)
        first = min(first, e.at)
        last = max(last, e.at)
    old: list[tuple[str, int]] = []
    for kind, keys in by_kind.items():  # the rows these entries replace, a few statements per batch
        if len(keys) == 1:
            old += db.execute(_LOG_OLD_ONE, (session, kind, keys[0])).fetchall()
            continue
        for start in range(0, len(keys), 500):
            chunk = keys[start:start + 500]
            # INDEXED BY: without statistics SQLite would scan the session's rows by seq
            old += db.execute("SELECT seq, length(data) FROM log INDEXED BY log_by_key WHERE session=? "
                              f"AND kind=? AND key IN ({','.join('?' * len(chunk))})",
                              (session, kind, *chunk)).fetchall()
    if old:  # the INSERT OR REPLACE below deletes them (log_by_key is unique): only the totals change here
        count -= len(old)
        size -= sum(n for _, n in old)
    if len(rows) == 1:
        db.execute(_LOG_INSERT, rows[0])
    else:
        db.executemany(_LOG_INSERT, rows)
    count += len(rows)
    cutoff = now - keep.max_age_s * 1000 if keep.max_age_s > 0 else float("-inf")
    # Retention trims back to its bounds exactly, but only once the log is past one by a sixteenth
    # (large bounds): a busy log at its bound then trims once per ~625 events, in one DELETE,
    # instead of a cursor and a DELETE in every commit (each acknowledged event is one).
    slack_n = keep.max_entries // 16 if keep.max_entries >= 256 else 0
    slack_b = keep.max_bytes // 16 if keep.max_bytes >= 65536 else 0
    over = (keep.max_entries > 0 and count > keep.max_entries + slack_n) or \
        (keep.max_bytes > 0 and size > keep.max_bytes + slack_b)
    if meta is None:  # no totals yet (the session's first write): read the oldest now
        oldest = db.execute("SELECT min(at) FROM log WHERE session=?", (session,)).fetchone()[0]
    # `oldest` was read before this batch: the oldest now is no older (rows only went, or came newer)
    # unless an entry of the batch is older still, so this over-approximates what is too old
    late = cutoff - keep.max_age_s * 1000 / 16
    aged = first < late or (oldest is not None and oldest < late)
    if count > 1 and (over or aged):
        cut = None
        trim = db.execute("SELECT seq, at, length(data) FROM log WHERE session=? ORDER BY seq", (session,))
        try:
            for seq, at, n in trim:
                if count <= 1 or not ((count > keep.max_entries > 0) or (size > keep.max_bytes > 0)
                                      or at < cutoff):
                    break
                cut, count, size = seq, count - 1, size - n
        finally:
            trim.close()
        if cut is not None:
            db.execute("DELETE FROM log WHERE session=? AND seq<=?", (session, cut))
            floor = max(floor, cut)
    db.execute("INSERT OR REPLACE INTO log_meta(session, floor, count, bytes) VALUES (?, ?, ?, ?)",
               (session, floor, count, size))
    # The session was active when its events happened, not when the write-behind wrote them:
    # a later write of an earlier event must not make the session look newer than it is.
    touched = db.execute("UPDATE sessions SET last_used=MAX(last_used, ?) WHERE session=?", (last, session))
    if not touched.rowcount:
        db.execute("INSERT INTO sessions(session, last_used) VALUES (?, ?)", (session, last))
        return True
    return False
