//! Reading the next page of the log, in named steps: hold the cursor's lease, find where
//! the page starts (opening a tick when the last one is done), read its rows, register it
//! among the pages in flight (waiting for earlier pages of its aggregates), and sort its
//! rows into those to publish, those to hand over and those that cannot be read.
//!
//! A page that did not finish (its relay crashed or hung on it) is read again from the same
//! place, half as large each time: the row that crashes or wedges every relay ends up
//! alone. Each row of such a page was in every page that failed there, so it is on that
//! many attempts more; once they reach `max_attempts` the page goes to the per-row side with
//! them spent (the next claim there ends it dead). A finish that moves the cursor on
//! forgets them: they count against that one place only.

use std::collections::HashSet;
use std::sync::Arc;

use tokio::time::Instant;

use super::Log;
use super::cursor::{Empty, Lease, Next, ReadAt, Registered, Taken};
use super::finish::Page;
use super::statements::{Advanced, Guard, Opened, PageRow};
use crate::error::Result;
use crate::publisher::Record;
use crate::relay::options::Options;
use crate::relay::outcome::{Claimed, Outcome};

/// What a page read gives the batch.
pub(crate) struct PageRead {
    pub(crate) page: Page,
    /// Records to publish, in id order.
    pub(crate) ready: Vec<Claimed>,
    /// Rows that cannot be turned into a record: they die on their own.
    pub(crate) undecodable: Vec<(Record, Outcome)>,
}

/// How large a page read at `page_attempts` (pages that failed at its place) is, out of
/// `room`: halved per attempt, down to one row.
fn shrunk(room: usize, page_attempts: i32) -> usize {
    let attempts = u32::try_from(page_attempts).unwrap_or(0);
    room.checked_shr(attempts).unwrap_or(0).max(1)
}

impl Log {
    /// Reads the next page of at most `room` rows, opening a tick when the last one is
    /// done; `None` when there is nothing to read now. The batch's own rows on the
    /// per-row side (`besides`) go out before the page's.
    pub(crate) async fn next_page(
        self: &Arc<Self>,
        options: &Options,
        room: usize,
        besides: Vec<i64>,
    ) -> Result<Option<PageRead>> {
        let _reader = self.reader.lock().await;
        if !self.hold_lease(options).await? {
            return Ok(None);
        }
        let Some(at) = self.position(options).await? else {
            return Ok(None);
        };
        let size = shrunk(room, at.row.page_attempts);
        // One row more than the page takes, to tell a page that ends the tick.
        let rows = self
            .table
            .read_page(&at.row, at.from, size + 1, options.max_batch_bytes)
            .await?;
        let Some((page, rows)) = self.register(&at, rows, size, options).await? else {
            return Ok(None);
        };
        self.sort(page, rows, at.row.page_attempts, besides, options)
            .await
            .map(Some)
    }

    /// Takes the cursor's lease, or renews it once half of it is gone: false when the
    /// table has no cursor or another relay holds it.
    async fn hold_lease(&self, options: &Options) -> Result<bool> {
        let version = {
            let cursor = self.cursor();
            match cursor.lease(Instant::now()) {
                Lease::Held => return Ok(true),
                Lease::NotNow => return Ok(false),
                Lease::Take => cursor.version(),
            }
        };
        let asked = Instant::now();
        let row = self.table.take(&self.owner, options.cursor_lease).await?;
        let taken = self
            .cursor()
            .taken(row, asked, options.cursor_lease, version);
        self.say(&taken);
        Ok(taken != Taken::Not)
    }

    /// Where the next page starts: in the open tick, or at the start of the next one,
    /// opened now; `None` when there is nothing to read.
    async fn position(&self, options: &Options) -> Result<Option<ReadAt>> {
        // A tick open that finds the cursor moved under this relay reads from there: once.
        for _ in 0..2 {
            let next = self.cursor().next();
            let at = match next {
                Next::Wait => return Ok(None),
                Next::Read(at) => return Ok(Some(at)),
                Next::Open(at) => at,
            };
            let asked = Instant::now();
            match self.table.open_tick(&at, options.cursor_lease).await? {
                Opened::Tick(row) => {
                    tracing::trace!(table = %self.name, tick = row.tick, "opened a tick");
                    self.cursor().opened(row, asked, options.cursor_lease);
                }
                Opened::Not(row) => {
                    let taken = self
                        .cursor()
                        .not_opened(&at, row, asked, options.cursor_lease);
                    self.say(&taken);
                    if !matches!(taken, Taken::Moved { .. }) {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(match self.cursor().next() {
            Next::Read(at) => Some(at),
            Next::Wait | Next::Open(_) => None,
        })
    }

    /// Says what a take or a tick open found, where it is news.
    pub(super) fn say(&self, taken: &Taken) {
        match taken {
            Taken::Anew { token, tick } => {
                tracing::info!(table = %self.name, token, tick, "took the log's cursor");
            }
            Taken::Moved { from, to, tick } => tracing::warn!(
                table = %self.name, tick, from, to,
                "the log's cursor is not where this relay left it (a write the database lost \
                 in a failover or a crash, or an operator's change): reading on from where \
                 it is, publishing again what lies between"
            ),
            Taken::Renewed | Taken::Not => {}
        }
    }

    /// Registers the page `rows` make (read from `at`, at most `size` of them a page) among
    /// the pages in flight, and waits for the earlier pages that hold messages of its
    /// aggregates. With no rows, the tick is read: once no page is out, the cursor goes to
    /// the tick's end, and the next look opens a tick.
    async fn register(
        self: &Arc<Self>,
        at: &ReadAt,
        rows: Vec<PageRow>,
        size: usize,
        options: &Options,
    ) -> Result<Option<(Page, Vec<PageRow>)>> {
        let guard = Guard {
            token: at.row.token,
            tick: at.row.tick,
            from: at.from,
        };
        let Some(last) = rows.last().map(|r| r.message.id) else {
            if self.cursor().read_nothing(at) == Empty::Skip {
                let advanced = self
                    .table
                    .advance(
                        guard,
                        at.row.ceiling,
                        at.row.page_attempts,
                        &[],
                        options.cursor_lease,
                    )
                    .await?;
                self.cursor().skipped(at, advanced == Advanced::Moved);
            }
            return Ok(None);
        };
        let read = usize::try_from(rows[0].read).unwrap_or(usize::MAX);
        let tick_end = read <= size && rows.len() == read;
        let to = if tick_end { at.row.ceiling } else { last };
        let aggregates: HashSet<String> = rows
            .iter()
            .filter_map(|r| r.message.aggregate_key.clone())
            .collect();
        let Some(Registered { seq, earlier }) =
            self.cursor().register(at, to, tick_end, aggregates)
        else {
            return Ok(None);
        };
        let page = Page::new(
            self.clone(),
            seq,
            at.generation,
            guard,
            at.row.page_attempts,
            options.cursor_lease,
            to,
            rows.iter()
                .map(|r| (r.message.id, r.message.aggregate_key.clone()))
                .collect(),
        );
        if !earlier.is_empty() {
            // Earlier pages in flight hold messages of these aggregates: their outcomes (a
            // hand-over, say) decide what happens to this page's.
            self.wait_until(|c| c.finished_all(&earlier)).await;
            if !self.cursor().current(at.generation) {
                // An earlier page was cut short (an outage): its unfinished messages are
                // read again, and this page's of their aggregates must not go first.
                page.abandon();
                return Ok(None);
            }
        }
        Ok(Some((page, rows)))
    }

    /// What each row of the page becomes: published; handed to the per-row side (delayed,
    /// or behind its aggregate's rows there other than the batch's own, which go out
    /// before it); dead (it cannot be read); or, in a page read at a place where
    /// `max_attempts` pages failed, handed over with those attempts spent.
    async fn sort(
        &self,
        mut page: Page,
        rows: Vec<PageRow>,
        page_attempts: i32,
        besides: Vec<i64>,
        options: &Options,
    ) -> Result<PageRead> {
        let aggregates: Vec<String> = rows
            .iter()
            .filter_map(|r| r.message.aggregate_key.clone())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let behind = if aggregates.is_empty() {
            HashSet::new()
        } else {
            self.table.pending_aggregates(aggregates, besides).await?
        };
        let failed = u32::try_from(page_attempts).unwrap_or(0);
        let exhausted = failed >= options.max_attempts;
        if exhausted {
            tracing::error!(
                table = %self.name, rows = rows.len(), attempts = failed,
                "a page of the log was read again and again without finishing (a relay crashing or \
                 hanging on it): its messages go to the per-row side, whose max_attempts ends such a row dead"
            );
        }
        let attempt = failed + 1;
        let token = page.token();
        let mut moved_aggregates: HashSet<String> = behind;
        let mut ready = Vec::with_capacity(rows.len());
        let mut undecodable = Vec::new();
        for row in rows {
            let moved_behind = row
                .message
                .aggregate_key
                .as_ref()
                .is_some_and(|a| moved_aggregates.contains(a));
            let delayed = row.delayed;
            let (record, bad) = row.message.record(attempt);
            if exhausted || delayed || moved_behind {
                if let Some(a) = &record.aggregate_key {
                    moved_aggregates.insert(a.clone());
                }
                let mut moved = Outcome::moved(record.id);
                if exhausted {
                    // The attempts it spent: the per-row side's next claim of a row at
                    // max_attempts ends it dead.
                    moved.attempt = failed;
                }
                page.hand_over(moved);
            } else if let Some(why) = bad {
                if let Some(a) = &record.aggregate_key {
                    moved_aggregates.insert(a.clone());
                }
                let outcome = Outcome::dead(&record, token, &why);
                undecodable.push((record, outcome));
            } else {
                ready.push(Claimed { record, token });
            }
        }
        Ok(PageRead {
            page,
            ready,
            undecodable,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::shrunk;

    #[test]
    fn a_page_that_never_finishes_halves_down_to_one_row() {
        assert_eq!(shrunk(100, 0), 100);
        assert_eq!(shrunk(100, 1), 50);
        assert_eq!(shrunk(100, 6), 1);
        assert_eq!(shrunk(100, 7), 1);
        assert_eq!(shrunk(1, 3), 1);
        assert_eq!(shrunk(512, 200), 1);
        assert_eq!(shrunk(512, -1), 512, "a spoilt count is none");
    }
}
