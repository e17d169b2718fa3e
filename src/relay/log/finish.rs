//! A page of the log in its batch, and its finish: once the page before it finished, the
//! cursor moves past the longest prefix of the page whose every message is confirmed or
//! handed over, and those handed over go to the per-row side, in one transaction.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::Log;
use super::statements::{Advanced, Guard};
use crate::relay::limits::RECORD_GRACE;
use crate::relay::outcome::{
    OUTCOME_DEAD, OUTCOME_MOVE, OUTCOME_RELEASE, OUTCOME_RETRY, OUTCOME_SENT, Outcome,
};
use crate::relay::store::{End, Finish, LeaseEnd};
use crate::shutdown::retry_until;

/// A page of the log in a batch: what its finish needs.
#[derive(Debug)]
pub(crate) struct Page {
    log: Arc<Log>,
    seq: u64,
    generation: u64,
    /// The cursor as the page was read from it.
    guard: Guard,
    page_attempts: i32,
    /// The cursor's lease, renewed by the finish.
    lease: Duration,
    /// Where the cursor goes once every message of the page is done.
    to: i64,
    /// Every row of the page in id order, with its aggregate.
    rows: Vec<(i64, Option<String>)>,
    /// Rows handed over without being published (delayed, behind the per-row side, a
    /// page past its attempts), with their outcomes.
    handed: Vec<Outcome>,
    done: bool,
}

/// What the relay does with a row of a finished page.
#[derive(Debug, PartialEq, Eq)]
enum Fate {
    Done,
    HandOver,
    Unfinished,
}

impl Page {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        log: Arc<Log>,
        seq: u64,
        generation: u64,
        guard: Guard,
        page_attempts: i32,
        lease: Duration,
        to: i64,
        rows: Vec<(i64, Option<String>)>,
    ) -> Self {
        Page {
            log,
            seq,
            generation,
            guard,
            page_attempts,
            lease,
            to,
            rows,
            handed: Vec::new(),
            done: false,
        }
    }

    /// The token of the cursor the page was read under.
    pub(super) fn token(&self) -> i64 {
        self.guard.token
    }

    /// Hands a row over without publishing it.
    pub(super) fn hand_over(&mut self, outcome: Outcome) {
        self.handed.push(outcome);
    }

    /// Gives the page up before anything of it was published: it finishes nothing.
    pub(super) fn abandon(mut self) {
        self.done = true;
        let seq = self.seq;
        self.log.finished(|c| c.abandoned(seq));
    }

    /// Finishes the page after the one before it: moves the cursor past the longest
    /// prefix whose every message is confirmed or handed over, and hands those over, in one
    /// transaction. A page cut short by an outage costs no attempt. Retries until `end.by`;
    /// a finish that cannot be made leaves the cursor where it is, and the page is read
    /// again. Returns how many outcomes were discarded because another relay took the
    /// cursor over.
    async fn settle(mut self: Box<Self>, outcomes: Vec<Outcome>, end: End) -> usize {
        let log = self.log.clone();
        let seq = self.seq;
        log.wait_until(|c| c.turn_of(seq)).await;
        if !log.cursor().current(self.generation) {
            self.done = true;
            log.finished(|c| c.abandoned(seq));
            return 0;
        }
        let (to, hand_over, cut) = self.fates(outcomes, end.outage);
        // Attempts count against the place the cursor is at: the page that did not finish
        // there. Once a finish moves the cursor past it, they are gone.
        let page_attempts = if to > self.guard.from {
            0
        } else {
            self.page_attempts
        };
        let unchanged =
            to == self.guard.from && hand_over.is_empty() && page_attempts == self.page_attempts;
        let advanced = if unchanged {
            Some(Advanced::Moved)
        } else {
            self.advance(to, page_attempts, &hand_over, end).await
        };
        self.done = true;
        let guard = self.guard;
        match advanced {
            Some(Advanced::Moved) => {
                if let Some(due) = hand_over.iter().map(|o| o.delay).min() {
                    log.handed(Instant::now() + due);
                }
                log.finished(|c| c.moved(seq, guard, to, page_attempts, cut));
                0
            }
            Some(Advanced::Guarded { token }) if token == Some(guard.token) => {
                tracing::warn!(
                    table = %log.name, rows = self.rows.len(),
                    "the log's cursor is not where this relay left it (a write the database \
                     lost in a failover or a crash, or an operator's change): reading it again; \
                     this page's messages may be published again"
                );
                log.finished(|c| c.lost(seq));
                0
            }
            Some(Advanced::Guarded { .. }) => {
                tracing::warn!(
                    table = %log.name, fenced = self.rows.len(),
                    "page outcomes discarded: another relay took the log's cursor over"
                );
                log.finished(|c| c.lost(seq));
                self.rows.len()
            }
            None => {
                tracing::error!(
                    table = %log.name, rows = self.rows.len(),
                    "finishing a page of the log failed; it will be read and published again"
                );
                log.finished(|c| c.lost(seq));
                0
            }
        }
    }

    /// Where the cursor goes and what is handed over, given the outcomes: confirmed is
    /// done; failed, or not to be published from the log, is handed over. Not published
    /// (shutdown, too late, or the relay lost the result) is handed over too, without an
    /// attempt charged, unless the broker is out of reach (`outage`); then the page is cut
    /// before it (`cut`) and read again after the outage.
    fn fates(&mut self, outcomes: Vec<Outcome>, outage: bool) -> (i64, Vec<Outcome>, bool) {
        let mut by_id: HashMap<i64, Outcome> = outcomes.into_iter().map(|o| (o.id, o)).collect();
        for handed in std::mem::take(&mut self.handed) {
            by_id.insert(handed.id, handed);
        }
        let mut handed_aggregates: HashSet<String> = HashSet::new();
        let mut hand_over: Vec<Outcome> = Vec::new();
        let mut last_done = self.guard.from;
        let mut cut = false;
        for (id, aggregate) in &self.rows {
            let outcome = by_id.remove(id);
            let behind_hand_over = aggregate
                .as_ref()
                .is_some_and(|a| handed_aggregates.contains(a));
            let fate = match &outcome {
                Some(o) if o.kind == OUTCOME_SENT => Fate::Done,
                Some(o) if [OUTCOME_RETRY, OUTCOME_DEAD, OUTCOME_MOVE].contains(&o.kind) => {
                    Fate::HandOver
                }
                _ if outage && !behind_hand_over => Fate::Unfinished,
                _ => Fate::HandOver,
            };
            match fate {
                Fate::Unfinished => {
                    cut = true;
                    break;
                }
                Fate::HandOver => {
                    if let Some(a) = aggregate {
                        handed_aggregates.insert(a.clone());
                    }
                    hand_over.push(match outcome {
                        Some(o) if o.kind != OUTCOME_RELEASE => o,
                        _ => Outcome::moved(*id),
                    });
                }
                Fate::Done => {}
            }
            last_done = *id;
        }
        let to = if cut { last_done } else { self.to };
        (to, hand_over, cut)
    }

    /// The compare-and-set and the hand-over in one transaction, retried until `end.by`:
    /// `None` when it failed throughout.
    async fn advance(
        &self,
        to: i64,
        page_attempts: i32,
        hand_over: &[Outcome],
        end: End,
    ) -> Option<Advanced> {
        let log = &self.log;
        retry_until(
            end.by,
            RECORD_GRACE,
            Some(end.stop),
            || {
                log.table
                    .advance(self.guard, to, page_attempts, hand_over, self.lease)
            },
            |e: &crate::Error, _| {
                tracing::warn!(table = %log.name, error = %e, "finishing a page failed; retrying");
            },
        )
        .await
    }
}

impl Finish for Page {
    fn holds(&self, id: i64) -> bool {
        self.rows.binary_search_by_key(&id, |(r, _)| *r).is_ok()
    }

    fn settled(&self) -> usize {
        self.handed.len()
    }

    fn lease_end(&self) -> Option<LeaseEnd> {
        let (log, token) = (self.log.clone(), self.guard.token);
        Some(Arc::new(move || log.cursor().held_until(token)))
    }

    fn finish(self: Box<Self>, outcomes: Vec<Outcome>, end: End) -> BoxFuture<'static, usize> {
        Box::pin(self.settle(outcomes, end))
    }
}

impl Drop for Page {
    /// A page dropped unfinished (its batch's task ended early, or the relay was dropped
    /// mid-publish) finishes nothing: the read position goes back, and the page is read
    /// again with one more attempt counted against it.
    fn drop(&mut self) {
        if !self.done {
            let (seq, guard, page_attempts) = (self.seq, self.guard, self.page_attempts);
            self.log.finished(|c| c.dropped(seq, guard, page_attempts));
        }
    }
}
