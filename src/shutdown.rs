//! Shutdown helpers shared by the relay and the consumer runner: waiting for the stop signal,
//! racing work against it, and background tasks that end with their owner.

use std::future::Future;

use tokio::sync::watch;
use tokio::task::JoinHandle;

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
