//! The limits of a run's pipeline, which the loop, the batches and the recording share.

use std::time::Duration;

/// Claimed batches publishing at once.
pub(super) const PIPELINE: usize = 3;
/// Stalled batches (waiting only on slow publishes) the relay keeps beside its pipeline
/// before it waits for their deadlines.
pub(super) const MAX_STALLED: usize = 3 * PIPELINE;
/// The most batches a run holds at once: fewer than two pipelines' worth publishing or
/// recording when it claims, the stalled ones beside them, and the one claimed then.
pub(super) const MAX_BATCHES: usize = 2 * PIPELINE + MAX_STALLED;
/// At shutdown, recording outcomes may take this long after the drain timeout.
pub(super) const RECORD_GRACE: Duration = Duration::from_secs(1);
