//! The closure adapter: `publisher_fn(|record| async { .. })`.

use std::fmt;
use std::future::Future;

use super::{PublishError, Publisher, Record};

/// A [`Publisher`] made from a closure; see [`publisher_fn`].
pub struct FnPublisher<F> {
    f: F,
}

impl<F> fmt::Debug for FnPublisher<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnPublisher")
    }
}

/// Adapts a closure that takes an owned [`Record`] into a [`Publisher`].
///
/// ```
/// use diesel_outbox::{PublishError, publisher_fn};
///
/// let publisher = publisher_fn(|record| async move {
///     tracing::info!(key = %record.key, "would publish");
///     Ok::<_, PublishError>(())
/// });
/// # let _ = publisher;
/// ```
pub fn publisher_fn<F, Fut>(f: F) -> FnPublisher<F>
where
    F: Fn(Record) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), PublishError>> + Send,
{
    FnPublisher { f }
}

impl<F, Fut> Publisher for FnPublisher<F>
where
    F: Fn(Record) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), PublishError>> + Send,
{
    fn publish(&self, record: &Record) -> impl Future<Output = Result<(), PublishError>> + Send {
        (self.f)(record.clone())
    }
}
