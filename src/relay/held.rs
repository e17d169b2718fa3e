//! The rows a relay holds claimed, batch by batch, until their outcomes are recorded.
//!
//! A lease keeps other relays off a claim; this keeps the relay itself off it. A batch can
//! outlive its lease without anything going wrong in it: a publisher that blocks its thread,
//! or a panicking publish whose panic hook resolves a backtrace's symbols (with
//! `RUST_BACKTRACE` set that takes a fifth of a second on an idle machine, seconds on a
//! loaded one), stalls the batch's task while the relay's loop goes on claiming. Rows whose
//! lease has run out are due again, so the loop's next claim would take back rows whose
//! outcomes its own batch is about to record: a message already confirmed would then be
//! fenced off and published again. So every claim passes the rows of this relay's batches
//! that are old enough for their leases to have run out, and leaves them alone.
//!
//! Another relay may still take such rows over (that is what leases are for), and this
//! relay's late outcomes are then fenced off.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// The batches one relay holds (shared by its runs, as the publisher is).
#[derive(Debug, Default)]
pub(super) struct Held {
    batches: Mutex<Vec<HeldBatch>>,
    next: AtomicU64,
}

#[derive(Debug)]
struct HeldBatch {
    id: u64,
    claimed_at: Instant,
    rows: Vec<i64>,
}

impl Held {
    /// Holds the rows of a batch claimed at `claimed_at` until the returned guard drops.
    pub(super) fn hold(self: &std::sync::Arc<Self>, claimed_at: Instant, rows: Vec<i64>) -> Hold {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().push(HeldBatch {
            id,
            claimed_at,
            rows,
        });
        Hold {
            held: self.clone(),
            id,
        }
    }

    /// The rows of batches claimed at least half a lease ago. Younger leases cannot have
    /// run out (each ends a full lease after its claim started), so in the common case this
    /// is empty and the claim's exclusion costs nothing.
    pub(super) fn aged(&self, lease: Duration) -> Vec<i64> {
        let now = Instant::now();
        self.lock()
            .iter()
            .filter(|b| b.claimed_at + lease / 2 <= now)
            .flat_map(|b| b.rows.iter().copied())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<HeldBatch>> {
        // Nothing panics while holding the lock; a poisoned one is still consistent.
        self.batches
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One batch's rows, held until its outcomes are recorded (or given up).
#[derive(Debug)]
pub(crate) struct Hold {
    held: std::sync::Arc<Held>,
    id: u64,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.held.lock().retain(|b| b.id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn only_batches_past_half_their_lease_are_named_and_only_while_held() {
        let held = Arc::new(Held::default());
        let lease = Duration::from_secs(10);
        let old = held.hold(Instant::now(), vec![1, 2]);
        tokio::time::sleep(lease / 2).await;
        let young = held.hold(Instant::now(), vec![3]);
        assert_eq!(held.aged(lease), [1, 2]);
        drop(old);
        assert!(held.aged(lease).is_empty());
        tokio::time::sleep(lease).await;
        assert_eq!(held.aged(lease), [3]);
        drop(young);
        assert!(held.aged(lease).is_empty());
    }
}
