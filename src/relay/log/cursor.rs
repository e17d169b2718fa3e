//! What one relay knows of the log's cursor between its pages: the lease it holds and the
//! cursor row as it last read or wrote it, how far the open tick is read, and the pages
//! read and not yet finished. A plain value without I/O: the engine keeps it under a lock
//! and takes each decision in one call, on the state as it is then, so that no decision
//! rests on a copy that a finish has overtaken since.
//!
//! The database's cursor is the truth. The relay's view of it is a cache that only its own
//! writes move; a take or a tick open that finds the cursor elsewhere under the relay's own
//! token (a write the database lost after a failover or a crash, an operator's change)
//! moves the relay there, and a guard that matches nothing on a finish makes the relay read
//! the cursor again.
//!
//! Pages are numbered (`seq`) in the order they are read; they finish in that order. The
//! *generation* counts the times the read position went back (a page cut short, a finish
//! that failed, the cursor lost, moved or given back): a page of an older generation
//! finishes nothing, and is read again.

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
    /// The last take or renewal that reached the database: asked then, for that long.
    /// The database's lease ends no earlier than its end, since the statement ran after
    /// it was asked.
    renewed: Renewal,
}

/// A take or renewal of the lease, asked at `asked` for `lease`.
#[derive(Debug, Clone, Copy)]
struct Renewal {
    asked: Instant,
    lease: Duration,
}

impl Renewal {
    /// When the lease should be renewed: half of it gone.
    fn due(self) -> Instant {
        self.asked + self.lease / 2
    }

    /// When the lease ends unless renewed again, as this relay can be sure of it.
    fn end(self) -> Instant {
        self.asked + self.lease
    }
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
    /// Bumped whenever the relay's view of the cursor's place changes: a take answered
    /// after such a change was asked before it, and may be older than the view.
    version: u64,
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

/// What a take (or a tick open that opened nothing) told.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Taken {
    /// This relay holds the cursor, where it left it.
    Renewed,
    /// This relay holds it now and did not before (or under another token): it reads from
    /// the cursor's position.
    Anew { token: i64, tick: i64 },
    /// This relay held it, but the cursor is not where the relay left it: the relay reads
    /// from where it is (publishing again what lies behind the relay's view).
    Moved { from: i64, to: i64, tick: i64 },
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
            && now < held.renewed.due()
        {
            return Lease::Held;
        }
        if self.retry_at.is_some_and(|at| now < at) {
            return Lease::NotNow;
        }
        Lease::Take
    }

    /// The relay's view of the cursor's place, as a number every change of it bumps: read
    /// before a take is asked, and handed to [`Cursor::taken`] with its answer.
    pub(super) fn version(&self) -> u64 {
        self.version
    }

    /// A take asked at `asked`, when the view's [`version`](Cursor::version) was
    /// `version`, answered `row` (the cursor as the database holds it).
    ///
    /// Under this relay's token, a cursor found elsewhere than the relay left it moves the
    /// relay there, unless a page is in flight or the view changed since the take was
    /// asked: then the view is kept, and the next finish's guard tells whether the cursor
    /// moved.
    pub(super) fn taken(
        &mut self,
        row: Option<CursorRow>,
        asked: Instant,
        lease: Duration,
        version: u64,
    ) -> Taken {
        let Some(row) = row else {
            self.held = None;
            self.retry_at = Some(Instant::now() + TAKE_RETRY.min(lease / 2));
            return Taken::Not;
        };
        self.retry_at = None;
        let renewed = Renewal { asked, lease };
        let Some(held) = self.held.as_mut().filter(|h| h.row.token == row.token) else {
            let taken = Taken::Anew {
                token: row.token,
                tick: row.tick,
            };
            self.adopt(row, renewed);
            return taken;
        };
        let unsure = !self.in_flight.is_empty() || version != self.version;
        if unsure || held.row.same_place(&row) {
            // Keep what this relay's own finishes wrote since, and the attempts it counted
            // in memory.
            held.renewed = renewed;
            return Taken::Renewed;
        }
        let moved = Taken::Moved {
            from: held.row.after,
            to: row.after,
            tick: row.tick,
        };
        self.adopt(row, renewed);
        moved
    }

    /// A heartbeat's take, asked at `asked`, answered `row`. Under this relay's token it
    /// renews the lease and nothing else: the answer may hold a write of this relay's own
    /// that committed before the relay's view took it in (a tick opened, a page finished),
    /// and the relay's own statements, guarded by the cursor's place, find a cursor that
    /// moved under it. Otherwise it is a take ([`Cursor::taken`]).
    pub(super) fn kept(
        &mut self,
        row: Option<CursorRow>,
        asked: Instant,
        lease: Duration,
        version: u64,
    ) -> Taken {
        if let (Some(held), Some(row)) = (self.held.as_mut(), row.as_ref())
            && held.row.token == row.token
        {
            self.retry_at = None;
            held.renewed = Renewal { asked, lease };
            return Taken::Renewed;
        }
        self.taken(row, asked, lease, version)
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
        self.version += 1;
        self.read_to = row.after;
        self.tick_read = row.after >= row.ceiling;
        self.held = Some(Held {
            row,
            renewed: Renewal { asked, lease },
        });
    }

    /// A tick open from `at` opened nothing, and found the cursor as `row` (`None`: the
    /// table has none). At the place the relay knows under its token, nothing committed
    /// since (`Renewed`); elsewhere under its token, the cursor moved under the relay,
    /// which now reads from there (`Moved`); under another token, or none, the relay no
    /// longer holds it (`Not`).
    pub(super) fn not_opened(
        &mut self,
        at: &CursorRow,
        row: Option<CursorRow>,
        asked: Instant,
        lease: Duration,
    ) -> Taken {
        let Some(row) = row.filter(|r| r.token == at.token) else {
            self.lose();
            return Taken::Not;
        };
        if row.same_place(at) {
            return Taken::Renewed;
        }
        let moved = Taken::Moved {
            from: at.after,
            to: row.after,
            tick: row.tick,
        };
        self.adopt(row, Renewal { asked, lease });
        moved
    }

    /// Holds `row` as the database has it, reading from its position.
    fn adopt(&mut self, row: CursorRow, renewed: Renewal) {
        self.generation += 1;
        self.version += 1;
        self.read_to = row.after;
        self.tick_read = row.after >= row.ceiling;
        self.held = Some(Held { row, renewed });
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
            self.version += 1;
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
            self.version += 1;
            held.row.after = to;
            held.row.page_attempts = page_attempts;
        }
        self.done(seq, cut);
    }

    /// Page `seq` could not move the cursor (its guard matched nothing, or the finish
    /// failed): the cursor is read again, and the pages after it too.
    pub(super) fn lost(&mut self, seq: u64) {
        self.held = None;
        self.version += 1;
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
        self.version += 1;
    }

    /// Until when the lease under `token` holds, as this relay can be sure of it (`None`:
    /// it holds the cursor under no such token now). Past it another relay may have taken
    /// the cursor over and be publishing what this relay read: a page read under `token`
    /// starts no publish once it is near, and cuts off those under way when it comes.
    pub(super) fn held_until(&self, token: i64) -> Option<Instant> {
        self.held
            .as_ref()
            .filter(|h| h.row.token == token)
            .map(|h| h.renewed.end())
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

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    /// A cursor of `token` in `tick` (ids 1 to `ceiling`), done up to `after`.
    fn row(token: i64, tick: i64, after: i64, ceiling: i64) -> CursorRow {
        CursorRow {
            lo: format!("{tick}:{tick}:"),
            hi: format!("{}:{}:", tick + 1, tick + 1),
            ceiling,
            after,
            walk_from: 0,
            tick,
            page_attempts: 0,
            token,
        }
    }

    fn held(cursor: &mut Cursor, row: CursorRow) {
        let version = cursor.version();
        cursor.taken(Some(row), Instant::now(), LEASE, version);
    }

    fn read(cursor: &mut Cursor) -> ReadAt {
        match cursor.next() {
            Next::Read(at) => at,
            other => panic!("expected a read, got {other:?}"),
        }
    }

    fn guard(at: &ReadAt) -> Guard {
        Guard {
            token: at.row.token,
            tick: at.row.tick,
            from: at.from,
        }
    }

    #[test]
    fn pages_are_read_in_turn_and_the_tick_opens_once_its_last_page_finished() {
        let mut c = Cursor::default();
        held(&mut c, row(7, 1, 0, 10));
        let first = read(&mut c);
        assert_eq!(first.from, 0);
        let p1 = c.register(&first, 5, false, HashSet::new()).unwrap();
        let second = read(&mut c);
        assert_eq!(second.from, 5);
        let p2 = c.register(&second, 10, true, HashSet::new()).unwrap();
        assert_eq!(c.next(), Next::Wait, "the tick is read, its pages are out");
        assert!(c.turn_of(p1.seq) && !c.turn_of(p2.seq));
        c.moved(p1.seq, guard(&first), 5, 0, false);
        assert!(c.turn_of(p2.seq));
        assert_eq!(c.next(), Next::Wait);
        c.moved(p2.seq, guard(&second), 10, 0, false);
        match c.next() {
            Next::Open(at) => assert_eq!((at.after, at.ceiling), (10, 10)),
            other => panic!("expected an open, got {other:?}"),
        }
    }

    /// The lease a page is published under ends a lease after the last renewal was asked,
    /// and at once for a page of a token the relay no longer holds.
    #[test]
    fn the_lease_held_ends_a_lease_after_its_last_renewal_was_asked() {
        let mut c = Cursor::default();
        let asked = Instant::now();
        c.taken(Some(row(7, 1, 0, 10)), asked, LEASE, c.version());
        assert_eq!(c.held_until(7), Some(asked + LEASE));
        assert_eq!(c.held_until(8), None, "another token");
        let later = asked + LEASE / 5;
        assert_eq!(
            c.kept(Some(row(7, 1, 0, 10)), later, LEASE, c.version()),
            Taken::Renewed
        );
        assert_eq!(c.held_until(7), Some(later + LEASE), "renewed");
        // Another relay took it over: the heartbeat's take finds nothing.
        assert_eq!(c.kept(None, later, LEASE, c.version()), Taken::Not);
        assert_eq!(c.held_until(7), None);
        // Taken again under a new token: a page of the old one stays out of it.
        c.taken(Some(row(9, 1, 0, 10)), later, LEASE, c.version());
        assert_eq!(
            (c.held_until(7), c.held_until(9)),
            (None, Some(later + LEASE))
        );
    }

    /// A heartbeat answered with a tick this relay opened, before its view took the open
    /// in: the lease is renewed, and the view is left to the open (no "moved" cursor).
    #[test]
    fn a_heartbeat_renews_without_moving_the_view() {
        let mut c = Cursor::default();
        held(&mut c, row(7, 1, 10, 10));
        let version = c.version();
        let newer = row(7, 2, 10, 20);
        assert_eq!(
            c.kept(Some(newer.clone()), Instant::now(), LEASE, version),
            Taken::Renewed
        );
        match c.next() {
            Next::Open(at) => assert_eq!((at.tick, at.after), (1, 10), "the view stays"),
            other => panic!("expected an open, got {other:?}"),
        }
        // The same answer to a take would have moved the relay.
        assert!(matches!(
            c.taken(Some(newer), Instant::now(), LEASE, version),
            Taken::Moved { .. }
        ));
        // Under another token, a heartbeat's answer is a take.
        let mut other = Cursor::default();
        held(&mut other, row(7, 1, 10, 10));
        let version = other.version();
        assert!(matches!(
            other.kept(Some(row(8, 1, 10, 10)), Instant::now(), LEASE, version),
            Taken::Anew { token: 8, .. }
        ));
    }

    /// The interleaving that made one relay fence itself: the tick's last page finishes
    /// between the relay's look at its lease and its choice of where to read. Decided on
    /// the state as it is then, the next step opens a tick; it never rereads the page that
    /// just finished.
    #[test]
    fn the_last_page_finishing_just_before_a_read_does_not_rewind_it() {
        let mut c = Cursor::default();
        held(&mut c, row(7, 1, 0, 10));
        let at = read(&mut c);
        let page = c.register(&at, 10, true, HashSet::new()).unwrap();
        // The next claim looks at its lease: held, no renewal due.
        assert_eq!(c.lease(Instant::now()), Lease::Held);
        // Its page finishes now, on another task.
        c.moved(page.seq, guard(&at), 10, 0, false);
        match c.next() {
            Next::Open(at) => assert_eq!(at.after, 10),
            other => panic!("expected an open, got {other:?}"),
        }
    }

    /// A take that finds the cursor behind where this relay left it, under its own token
    /// (a write the database lost): the relay reads from the database's position.
    #[test]
    fn a_take_that_finds_the_cursor_moved_back_reads_from_there() {
        let mut c = Cursor::default();
        held(&mut c, row(7, 1, 0, 10));
        let at = read(&mut c);
        let page = c.register(&at, 10, true, HashSet::new()).unwrap();
        c.moved(page.seq, guard(&at), 10, 0, false);
        let version = c.version();
        let taken = c.taken(Some(row(7, 1, 5, 10)), Instant::now(), LEASE, version);
        assert_eq!(
            taken,
            Taken::Moved {
                from: 10,
                to: 5,
                tick: 1
            }
        );
        assert_eq!(read(&mut c).from, 5, "the rows after 5 are read again");
    }

    /// The same take answered while a page is out, or after this relay wrote the cursor
    /// since the take was asked: the relay's view is kept (its finish then tells).
    #[test]
    fn a_take_older_than_the_relays_own_writes_is_not_believed() {
        let mut c = Cursor::default();
        held(&mut c, row(7, 1, 0, 10));
        let at = read(&mut c);
        let page = c.register(&at, 4, false, HashSet::new()).unwrap();
        let asked_at = c.version();
        assert_eq!(
            c.taken(Some(row(7, 1, 0, 10)), Instant::now(), LEASE, asked_at),
            Taken::Renewed,
            "a page is out"
        );
        // The take was asked before the page's finish wrote the cursor, and answered after.
        c.moved(page.seq, guard(&at), 4, 0, false);
        assert_eq!(
            c.taken(Some(row(7, 1, 0, 10)), Instant::now(), LEASE, asked_at),
            Taken::Renewed
        );
        assert_eq!(read(&mut c).from, 4);
    }

    #[test]
    fn a_tick_open_that_finds_the_cursor_elsewhere_tells_why() {
        let mut c = Cursor::default();
        let done = row(7, 1, 10, 10);
        held(&mut c, done.clone());
        let Next::Open(at) = c.next() else {
            panic!("the tick is done")
        };
        // Nothing committed: the cursor is where the relay left it.
        assert_eq!(
            c.not_opened(&at, Some(done.clone()), Instant::now(), LEASE),
            Taken::Renewed
        );
        // It moved back under the relay's token: read from there.
        assert_eq!(
            c.not_opened(&at, Some(row(7, 1, 5, 10)), Instant::now(), LEASE),
            Taken::Moved {
                from: 10,
                to: 5,
                tick: 1
            }
        );
        assert_eq!(read(&mut c).from, 5);
        // Another relay holds it: this one does not.
        let Next::Read(_) = c.next() else { panic!() };
        assert_eq!(
            c.not_opened(&at, Some(row(8, 1, 10, 10)), Instant::now(), LEASE),
            Taken::Not
        );
        assert_eq!(c.next(), Next::Wait);
    }

    #[test]
    fn a_page_cut_short_or_lost_sends_the_reading_back_and_later_pages_finish_nothing() {
        let mut c = Cursor::default();
        held(&mut c, row(7, 1, 0, 10));
        let first = read(&mut c);
        let p1 = c.register(&first, 5, false, HashSet::new()).unwrap();
        let second = read(&mut c);
        let p2 = c.register(&second, 10, true, HashSet::new()).unwrap();
        // The first page was cut at 3 by an outage.
        c.moved(p1.seq, guard(&first), 3, 0, true);
        assert!(
            !c.current(second.generation),
            "the second page finishes nothing"
        );
        c.abandoned(p2.seq);
        assert_eq!(read(&mut c).from, 3);
        // A finish that failed: the cursor is read again.
        c.lost(99);
        assert_eq!(c.next(), Next::Wait);
        assert_eq!(c.lease(Instant::now()), Lease::Take);
    }

    #[test]
    fn pages_of_one_aggregate_wait_for_the_earlier_ones() {
        let mut c = Cursor::default();
        held(&mut c, row(7, 1, 0, 10));
        let a = HashSet::from(["a".to_owned()]);
        let first = read(&mut c);
        let p1 = c.register(&first, 3, false, a.clone()).unwrap();
        let second = read(&mut c);
        let p2 = c
            .register(&second, 6, false, HashSet::from(["b".to_owned()]))
            .unwrap();
        let third = read(&mut c);
        let p3 = c.register(&third, 9, false, a).unwrap();
        assert!(p2.earlier.is_empty());
        assert_eq!(p3.earlier, [p1.seq]);
        assert!(!c.finished_all(&p3.earlier));
        c.moved(p1.seq, guard(&first), 3, 0, false);
        assert!(c.finished_all(&p3.earlier));
    }

    #[test]
    fn a_dropped_page_is_read_again_with_one_more_attempt() {
        let mut c = Cursor::default();
        held(&mut c, row(7, 1, 0, 10));
        let at = read(&mut c);
        let page = c.register(&at, 5, false, HashSet::new()).unwrap();
        c.dropped(page.seq, guard(&at), 0);
        let again = read(&mut c);
        assert_eq!((again.from, again.row.page_attempts), (0, 1));
    }

    #[test]
    fn no_cursor_is_looked_for_again_after_a_while() {
        let mut c = Cursor::default();
        assert_eq!(c.look(Instant::now()), Look::Yes);
        assert_eq!(
            c.taken(None, Instant::now(), LEASE, 0),
            Taken::Not,
            "the table has no cursor"
        );
        assert_eq!(c.lease(Instant::now()), Lease::NotNow);
        assert_eq!(c.look(Instant::now()), Look::No);
        assert_eq!(c.lease(Instant::now() + TAKE_RETRY), Lease::Take);
    }
}
