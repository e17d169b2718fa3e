//! Connections for a pooler that cannot track prepared statements, such as PgBouncer
//! before 1.21 in transaction mode: what works through one is in the crate docs ("Behind
//! a pooler").

use diesel::ConnectionResult;
use diesel::connection::CacheSize;
use diesel_async::{AsyncConnection, AsyncPgConnection};
use futures_util::future::BoxFuture;

/// Establishes an [`AsyncPgConnection`] to `database_url` with its prepared statement cache
/// off ([`CacheSize::Disabled`]), for a pooler that cannot track prepared statements; see
/// [Behind a pooler](crate#behind-a-pooler) for what else that needs. Its signature is
/// that of `ManagerConfig::custom_setup`, so a [`PgPool`](crate::PgPool) for the pooler
/// is:
///
/// ```no_run
/// use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
/// use diesel_async::{AsyncConnection, AsyncPgConnection};
/// use diesel_outbox::{EnqueueExt, Message, PgPool, establish_without_statement_cache};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let mut config = ManagerConfig::default();
/// config.custom_setup = Box::new(establish_without_statement_cache);
/// let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(
///     "postgres://app@pgbouncer.internal:6432/app",
///     config,
/// );
/// let pool: PgPool = PgPool::builder().build(manager).await?;
///
/// let mut conn = pool.get().await?;
/// conn.transaction(async |c| {
///     // ... insert the order on `c` ...
///     c.enqueue(Message::new("order.created", r#"{"id":42}"#)).await?;
///     Ok::<_, diesel_outbox::Error>(())
/// })
/// .await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// As [`AsyncPgConnection::establish`].
pub fn establish_without_statement_cache(
    database_url: &str,
) -> BoxFuture<'_, ConnectionResult<AsyncPgConnection>> {
    Box::pin(async move {
        let mut conn = AsyncPgConnection::establish(database_url).await?;
        conn.set_prepared_statement_cache_size(CacheSize::Disabled);
        Ok(conn)
    })
}
