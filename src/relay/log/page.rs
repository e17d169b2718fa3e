//! Reading the next page of the log, in named steps: hold the cursor's lease, find where
//! the page starts (opening a tick when the last one is done), read its rows, register it
//! among the pages in flight (waiting for earlier pages of its aggregates), and sort its
//! rows into those to publish, those to hand over and those that cannot be read.

use std::collections::HashSet;
use std::sync::Arc;

use tokio::time::Instant;

use super::Log;
use super::cursor::{Empty, Lease, Next, ReadAt, Registered, Taken};
use super::finish::Page;
use super::statements::{Guard, PageRow};
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

impl Log {
    /// Reads the next page of at most `room` rows, opening a tick when the last one is
    /// done; `None` when there is nothing to read now.
    pub(crate) async fn next_page(
        self: &Arc<Self>,
        options: &Options,
        room: usize,
    ) -> Result<Option<PageRead>> {
        let _reader = self.reader.lock().await;
        if !self.hold_lease(options).await? {
            return Ok(None);
        }
        let Some(at) = self.position(options).await? else {
            return Ok(None);
        };
        // After a page that never finished, pages shrink by half per attempt, down to one
        // row: a row that crashes or wedges every relay ends up alone in its page.
        let size = (room >> at.row.page_attempts.clamp(0, 16)).max(1);
        // One row more than the page takes, to tell a page that ends the tick.
        let rows = self
            .table
            .read_page(&at.row, at.from, size + 1, options.max_batch_bytes)
            .await?;
        let Some((page, rows)) = self.register(&at, rows, size, options).await? else {
            return Ok(None);
        };
        self.sort(page, rows, options).await.map(Some)
    }

    /// Takes the cursor's lease, or renews it once half of it is gone: false when the
    /// table has no cursor or another relay holds it.
    async fn hold_lease(&self, options: &Options) -> Result<bool> {
        match self.cursor().lease(Instant::now()) {
            Lease::Held => return Ok(true),
            Lease::NotNow => return Ok(false),
            Lease::Take => {}
        }
        let asked = Instant::now();
        let row = self.table.take(&self.owner, options.lease).await?;
        let taken = self.cursor().taken(row, asked, options.lease);
        if let Taken::Anew { token, tick } = taken {
            tracing::info!(table = %self.name, token, tick, "took the log's cursor");
        }
        Ok(taken != Taken::Not)
    }

    /// Where the next page starts: in the open tick, or at the start of the next one,
    /// opened now; `None` when there is nothing to read.
    async fn position(&self, options: &Options) -> Result<Option<ReadAt>> {
        let next = self.cursor().next();
        let row = match next {
            Next::Wait => return Ok(None),
            Next::Read(at) => return Ok(Some(at)),
            Next::Open(row) => row,
        };
        let asked = Instant::now();
        let Some(opened) = self.table.open_tick(&row, options.lease).await? else {
            return Ok(None);
        };
        tracing::trace!(table = %self.name, tick = opened.tick, "opened a tick");
        let mut cursor = self.cursor();
        cursor.opened(opened, asked, options.lease);
        Ok(match cursor.next() {
            Next::Read(at) => Some(at),
            Next::Wait | Next::Open(_) => None,
        })
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
                let moved = self
                    .table
                    .advance(
                        guard,
                        at.row.ceiling,
                        at.row.page_attempts,
                        &[],
                        options.lease,
                    )
                    .await?;
                self.cursor().skipped(at, moved);
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
            options.lease,
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

    /// What each row of the page becomes: published, handed to the per-row side (delayed,
    /// behind its aggregate's rows there, or the page read too often), or dead (it cannot
    /// be read).
    async fn sort(
        &self,
        mut page: Page,
        rows: Vec<PageRow>,
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
            self.table.pending_aggregates(aggregates).await?
        };
        let page_attempts = page.page_attempts();
        let exhausted = u32::try_from(page_attempts).unwrap_or(0) >= options.max_attempts;
        if exhausted {
            page.exhaust();
            tracing::error!(
                table = %self.name, rows = rows.len(), attempts = page_attempts,
                "a page of the log was read again and again without finishing (a relay crashing or \
                 hanging on it): its messages go to the per-row side, whose max_attempts ends such a row dead"
            );
        }
        let attempt = u32::try_from(page_attempts).unwrap_or(0) + 1;
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
                    // The attempts it has spent already: the per-row side's next claim
                    // of a row past max_attempts ends it dead.
                    moved.attempt = u32::try_from(page_attempts).unwrap_or(0);
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
