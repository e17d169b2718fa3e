//! Shutdown helpers shared by the relay and the consumer runner: waiting for the stop signal,
//! racing work against it, and background tasks that end with their owner.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::backoff::Backoff;

/// Completes once `stop` turns true (or its sender is gone).
pub(crate) async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is not `Send`: drop it here, not across an await.
    let _ = stop.wait_for(|stopping| *stopping).await.map(|_| ());
}

/// `work`'s output, or `None` if `stop` turns true first (then `work` is dropped): so work
/// of the crate's own, such as a bookkeeping write, never holds up a shutdown.
pub(crate) async fn or_stop<T>(
    stop: &watch::Receiver<bool>,
    work: impl Future<Output = T>,
) -> Option<T> {
    let mut stop = stop.clone();
    tokio::select! {
        out = work => Some(out),
        () = until_stopped(&mut stop) => None,
    }
}

/// Runs `attempt` again after each failure (`failed` is told the error and its number,
/// backoff 50 ms to 1 s) until it succeeds; gives up (`None`) once `by` has passed, or
/// `grace` after `stop` turns true. A deadline already past (its work was paused, say)
/// still gets `grace`: one try at least. For the relay's bookkeeping writes, whose loss
/// costs duplicates but never a message.
pub(crate) async fn retry_until<T, E, Fut>(
    by: Instant,
    grace: Duration,
    stop: Option<watch::Receiver<bool>>,
    mut attempt: impl FnMut() -> Fut,
    failed: impl Fn(&E, u32),
) -> Option<T>
where
    Fut: Future<Output = Result<T, E>>,
{
    let attempts = async {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        let mut n = 0u32;
        loop {
            n += 1;
            match attempt().await {
                Ok(done) => return done,
                Err(e) => {
                    failed(&e, n);
                    tokio::time::sleep(backoff.failed()).await;
                }
            }
        }
    };
    let shutdown = async {
        match stop {
            Some(mut stop) => {
                until_stopped(&mut stop).await;
                tokio::time::sleep(grace).await;
            }
            None => std::future::pending().await,
        }
    };
    let by = by.max(Instant::now() + grace);
    tokio::select! {
        done = tokio::time::timeout_at(by, attempts) => done.ok(),
        () = shutdown => None,
    }
}

/// Aborts a background task when dropped, so a dropped relay leaks nothing.
pub(crate) struct AbortOnDrop(Option<JoinHandle<()>>);

impl AbortOnDrop {
    pub(crate) fn new(task: JoinHandle<()>) -> Self {
        AbortOnDrop(Some(task))
    }

    /// Aborts the task and waits until it is gone (so it changes no state afterwards).
    pub(crate) async fn stop(mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}
