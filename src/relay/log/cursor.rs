//! What one relay knows of the log's cursor between its pages: the lease it holds and the
//! cursor row as it last read or wrote it, how far the open tick is read, and the pages
//! read and not yet finished. A plain value without I/O: the engine keeps it under a lock
//! and takes each decision in one call, on the state as it is then, so that no decision
//! rests on a copy that a finish has overtaken since.
//!
//! Pages are numbered (`seq`) in the order they are read; they finish in that order. The
//! *generation* counts the times the read position went back (a page cut short, a finish
//! that failed, the cursor lost or given back): a page of an older generation finishes
//! nothing, and is read again.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use super::statements::{CursorRow, Guard};

/// How long a relay that found no cursor it could take (the table is on the per-row
/// engine, or another relay holds it) waits before it looks again.
pub(super) const TAKE_RETRY: Duration = Duration::from_secs(1);

/// The cursor this relay holds, as it knows it.
#[derive(Debug, Clone)]
struct Held {
    row: CursorRow,
    /// When the lease should be renewed: half of it gone.
    renew_at: Instant,
}

/// The relay's knowledge of the cursor.
#[derive(Debug, Default)]
pub(super) struct Cursor {
    held: Option<Held>,
    /// No cursor could be taken: do not try again before then.
    retry_at: Option<Instant>,
    /// The last id read into a page of the open tick.
    read_to: i64,
    /// The open tick's last page was read.
    tick_read: bool,
    generation: u64,
    next_seq: u64,
    /// Pages read and not yet finished, by sequence number, with their aggregates.
    in_flight: BTreeMap<u64, HashSet<String>>,
}

/// What to do about the lease.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Lease {
    /// It is held, and need not be renewed yet.
    Held,
    /// Take it, or renew it.
    Take,
    /// No cursor could be taken a moment ago: not yet again.
    NotNow,
}

/// What a take told.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Taken {
    /// This relay holds the cursor now, as it held it before.
    Renewed,
    /// This relay holds it now and did not before (or holds another token or tick): it
    /// reads from the cursor's position.
    Anew { token: i64, tick: i64 },
    /// The table has no cursor, or another relay holds it.
    Not,
}

/// Where the next page comes from.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// Nothing to read now: no cursor held, or the open tick is read and pages of it are
    /// still in flight (a tick opens only once every page of the one before is finished).
    Wait,
    /// The open tick is done: open the next one after this cursor.
    Open(CursorRow),
    /// Read the next page of the open tick.
    Read(ReadAt),
}

/// A page read's starting point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ReadAt {
    pub(super) row: CursorRow,
    /// The last id read before; the page starts after it.
    pub(super) from: i64,
    pub(super) generation: u64,
}

/// A read that found nothing past its start.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Empty {
    /// The tick is read: wait for its pages, or open the next.
    Read,
    /// Every page is finished, yet the cursor is short of the tick's end: move it there.
    Skip,
}

/// A page registered as read.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Registered {
    pub(super) seq: u64,
    /// Earlier pages still in flight with messages of the same aggregates.
    pub(super) earlier: Vec<u64>,
}

/// Whether the log may have work, for the relay's cheap look.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Look {
    /// Yes, or it cannot tell without a take: take.
    Yes,
    /// Nothing until a page finishes (or the retry time comes).
    No,
    /// Whether anything committed since this snapshot (`hi`).
    Committed(String),
}

impl Cursor {
    /// What to do about the lease at `now`.
    pub(super) fn lease(&self, now: Instant) -> Lease {
        if let Some(held) = &self.held
            && now < held.renew_at
        {
            return Lease::Held;
        }
        if self.retry_at.is_some_and(|at| now < at) {
            return Lease::NotNow;
        }
        Lease::Take
    }

    /// A take asked at `asked` answered `row`.
    pub(super) fn taken(
        &mut self,
        row: Option<CursorRow>,
        asked: Instant,
        lease: Duration,
    ) -> Taken {
        let Some(row) = row else {
            self.held = None;
            self.retry_at = Some(Instant::now() + TAKE_RETRY.min(lease / 2));
            return Taken::Not;
        };
        self.retry_at = None;
        let renew_at = asked + lease / 2;
        let same = self
            .held
            .as_ref()
            .is_some_and(|h| h.row.token == row.token && h.row.tick == row.tick);
        if same {
            // Keep what this relay's own finishes wrote since.
            if let Some(held) = &mut self.held {
                held.renew_at = renew_at;
            }
            return Taken::Renewed;
        }
        let taken = Taken::Anew {
            token: row.token,
            tick: row.tick,
        };
        // Read from the committed position.
        self.generation += 1;
        self.read_to = row.after;
        self.tick_read = row.after >= row.ceiling;
        self.held = Some(Held { row, renew_at });
        taken
    }

    /// Where the next page comes from (see [`Next`]).
    pub(super) fn next(&mut self) -> Next {
        let Some(held) = &self.held else {
            return Next::Wait;
        };
        if self.tick_read {
            if !self.in_flight.is_empty() {
                return Next::Wait;
            }
            if held.row.after >= held.row.ceiling {
                return Next::Open(held.row.clone());
            }
            // Every page is finished, yet the cursor is short of the tick's end: read
            // again from where it is.
            self.read_to = held.row.after;
            self.tick_read = false;
        }
        Next::Read(ReadAt {
            row: held.row.clone(),
            from: self.read_to,
            generation: self.generation,
        })
    }

    /// A tick opened (asked at `asked`): `row` is the cursor at its start.
    pub(super) fn opened(&mut self, row: CursorRow, asked: Instant, lease: Duration) {
        self.read_to = row.after;
        self.tick_read = row.after >= row.ceiling;
        self.held = Some(Held {
            row,
            renew_at: asked + lease / 2,
        });
    }

    /// A read from `at` found nothing.
    pub(super) fn read_nothing(&mut self, at: &ReadAt) -> Empty {
        if !self.in_flight.is_empty() || at.from >= at.row.ceiling {
            if self.generation == at.generation {
                self.tick_read = true;
            }
            return Empty::Read;
        }
        Empty::Skip
    }

    /// The move of the cursor from `at` to the tick's end was written (`moved`), or its
    /// guard matched nothing.
    pub(super) fn skipped(&mut self, at: &ReadAt, moved: bool) {
        if !moved {
            self.lose();
            return;
        }
        if let Some(held) = &mut self.held
            && held.row.token == at.row.token
        {
            held.row.after = held.row.ceiling;
            self.read_to = held.row.ceiling;
            self.tick_read = true;
        }
    }

    /// A page read from `at` up to `to` (`tick_end`: the tick's last), with messages of
    /// `aggregates`: its number, or `None` when the read position went back meanwhile.
    pub(super) fn register(
        &mut self,
        at: &ReadAt,
        to: i64,
        tick_end: bool,
        aggregates: HashSet<String>,
    ) -> Option<Registered> {
        if self.generation != at.generation {
            return None;
        }
        self.read_to = to;
        self.tick_read = tick_end;
        let seq = self.next_seq;
        self.next_seq += 1;
        let earlier = self
            .in_flight
            .iter()
            .filter(|(_, a)| !a.is_disjoint(&aggregates))
            .map(|(s, _)| *s)
            .collect();
        self.in_flight.insert(seq, aggregates);
        Some(Registered { seq, earlier })
    }

    /// Whether every page read before `seq` is finished.
    pub(super) fn turn_of(&self, seq: u64) -> bool {
        self.in_flight
            .keys()
            .next()
            .is_none_or(|first| *first >= seq)
    }

    /// Whether none of `pages` is still in flight.
    pub(super) fn finished_all(&self, pages: &[u64]) -> bool {
        pages.iter().all(|p| !self.in_flight.contains_key(p))
    }

    /// Whether the read position has not gone back since `generation`.
    pub(super) fn current(&self, generation: u64) -> bool {
        self.generation == generation
    }

    /// Page `seq`, read under `guard`, moved the cursor to `to` (`cut`: short of its end,
    /// an outage: its rest is read again).
    pub(super) fn moved(&mut self, seq: u64, guard: Guard, to: i64, page_attempts: i32, cut: bool) {
        if let Some(held) = &mut self.held
            && held.row.token == guard.token
            && held.row.tick == guard.tick
        {
            held.row.after = to;
            held.row.page_attempts = page_attempts;
        }
        self.done(seq, cut);
    }

    /// Page `seq` could not move the cursor (its guard matched nothing, or the finish
    /// failed): the cursor is read again, and the pages after it too.
    pub(super) fn lost(&mut self, seq: u64) {
        self.held = None;
        self.done(seq, true);
    }

    /// Page `seq` finishes nothing: the read position went back before its turn.
    pub(super) fn abandoned(&mut self, seq: u64) {
        self.done(seq, false);
    }

    /// Page `seq`, read under `guard` with `page_attempts`, was dropped unfinished (its
    /// batch's task ended early): it is read again, with one more attempt counted.
    pub(super) fn dropped(&mut self, seq: u64, guard: Guard, page_attempts: i32) {
        if let Some(held) = &mut self.held
            && held.row.token == guard.token
            && held.row.tick == guard.tick
        {
            held.row.page_attempts = held.row.page_attempts.max(page_attempts + 1);
        }
        self.done(seq, true);
    }

    /// Forgets the cursor: the next take reads it again.
    pub(super) fn lose(&mut self) {
        self.held = None;
        self.generation += 1;
    }

    /// The token of the cursor held, to give it back.
    pub(super) fn token(&self) -> Option<i64> {
        self.held.as_ref().map(|h| h.row.token)
    }

    /// Whether the log may have work (see [`Look`]).
    pub(super) fn look(&self, now: Instant) -> Look {
        let Some(held) = &self.held else {
            // Not held: the next take tries to take it (at most every TAKE_RETRY).
            return if self.retry_at.is_none_or(|at| now >= at) {
                Look::Yes
            } else {
                Look::No
            };
        };
        if !self.tick_read {
            return Look::Yes;
        }
        if !self.in_flight.is_empty() {
            return Look::No;
        }
        Look::Committed(held.row.hi.clone())
    }

    fn done(&mut self, seq: u64, reset: bool) {
        self.in_flight.remove(&seq);
        if reset {
            self.generation += 1;
            if let Some(held) = &self.held {
                self.read_to = held.row.after;
                self.tick_read = held.row.after >= held.row.ceiling;
            }
        }
    }
}
