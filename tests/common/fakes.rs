//! Fake publishers and metrics for relay tests: they stand in for a broker where the test
//! is about the relay's logic (a real broker is tested in `rabbitmq.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel_outbox::{Metrics, PublishError, Publisher, Record, publisher_fn};
use tokio::sync::Notify;

/// Counts every metrics event.
#[derive(Default)]
pub struct Counters {
    pub claimed: AtomicUsize,
    pub published: AtomicUsize,
    pub failed: AtomicUsize,
    pub dead: AtomicUsize,
    pub released: AtomicUsize,
    pub fenced: AtomicUsize,
    pub blocked: AtomicUsize,
    pub unblocked: AtomicUsize,
}

#[derive(Clone, Default)]
pub struct CountingMetrics(Arc<Counters>);

impl CountingMetrics {
    pub fn get(&self, f: impl Fn(&Counters) -> &AtomicUsize) -> usize {
        AtomicUsize::load(f(&self.0), Ordering::SeqCst)
    }
}

impl Metrics for CountingMetrics {
    fn claimed(&self, n: usize) {
        self.0.claimed.fetch_add(n, Ordering::SeqCst);
    }
    fn published(&self, _: &str, _: u32, _: Duration) {
        self.0.published.fetch_add(1, Ordering::SeqCst);
    }
    fn failed(&self, _: &str, _: u32, _: &PublishError) {
        self.0.failed.fetch_add(1, Ordering::SeqCst);
    }
    fn dead_lettered(&self, _: &str, _: u32) {
        self.0.dead.fetch_add(1, Ordering::SeqCst);
    }
    fn released(&self, n: usize) {
        self.0.released.fetch_add(n, Ordering::SeqCst);
    }
    fn fenced(&self, n: usize) {
        self.0.fenced.fetch_add(n, Ordering::SeqCst);
    }
    fn blocked(&self, _: &PublishError) {
        self.0.blocked.fetch_add(1, Ordering::SeqCst);
    }
    fn unblocked(&self, _: Duration) {
        self.0.unblocked.fetch_add(1, Ordering::SeqCst);
    }
}

/// Records every successful publish.
#[derive(Clone, Default)]
pub struct Recorder(Arc<Mutex<Vec<Record>>>);

impl Recorder {
    /// Records `record` as published.
    pub fn push(&self, record: Record) {
        self.0.lock().unwrap().push(record);
    }
}

impl Recorder {
    pub fn records(&self) -> Vec<Record> {
        self.0.lock().unwrap().clone()
    }

    pub fn keys(&self) -> Vec<String> {
        self.records().into_iter().map(|r| r.key).collect()
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// A publisher that fails each record `fail` returns an error for, and records the rest
    /// here.
    pub fn failing<F>(&self, fail: F) -> impl Publisher
    where
        F: Fn(&Record) -> Option<PublishError> + Send + Sync + 'static,
    {
        let recorder = self.clone();
        let fail = Arc::new(fail);
        publisher_fn(move |record| {
            let recorder = recorder.clone();
            let fail = fail.clone();
            async move {
                match fail(&record) {
                    Some(err) => Err(err),
                    None => recorder.publish(&record).await,
                }
            }
        })
    }
}

impl Publisher for Recorder {
    async fn publish(&self, record: &Record) -> Result<(), PublishError> {
        self.0.lock().unwrap().push(record.clone());
        Ok(())
    }
}

/// A publisher whose publishes never finish: counts them and announces each start.
#[derive(Clone, Default)]
pub struct Hanging {
    pub calls: Arc<AtomicUsize>,
    pub started: Arc<Notify>,
}

impl Hanging {
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Publisher for Hanging {
    async fn publish(&self, _: &Record) -> Result<(), PublishError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.started.notify_one();
        std::future::pending().await
    }
}
