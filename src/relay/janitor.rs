//! Retention: purges old sent rows and inbox records in small batches.

use std::time::Duration;

use crate::ops::Purge;
use crate::outbox::Outbox;
use crate::sql::Sql;

use crate::connect::PgPool;

/// Rows per delete statement: small, so no statement holds locks for long.
const BATCH: i64 = 500;

/// Purges forever, at an interval derived from the shortest retention.
pub(crate) async fn run(
    outbox: Outbox,
    pool: PgPool,
    retention: Option<Duration>,
    inbox_retention: Option<Duration>,
) {
    let shortest = retention.into_iter().chain(inbox_retention).min();
    let Some(shortest) = shortest else { return };
    let interval = (shortest / 4).clamp(Duration::from_secs(1), Duration::from_secs(5 * 60));
    let jobs = [
        (
            "sent rows",
            retention,
            outbox.statements().ops.purge_sent.clone(),
        ),
        (
            "inbox records",
            inbox_retention,
            outbox.statements().ops.purge_inbox.clone(),
        ),
    ];
    loop {
        for (what, age, sql) in &jobs {
            let Some(age) = age else { continue };
            match purge(&outbox, &pool, sql, *age).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(table = %outbox.table(), purged = n, "purged old {what}"),
                Err(e) => {
                    tracing::error!(table = %outbox.table(), error = %e, "purging old {what} failed")
                }
            }
        }
        tokio::time::sleep(interval).await;
    }
}

async fn purge(
    outbox: &Outbox,
    pool: &PgPool,
    sql: &Sql<Purge>,
    age: Duration,
) -> crate::Result<u64> {
    let age = crate::ops::purge_age(age)?;
    let mut total = 0;
    loop {
        // A fresh checkout per batch: the janitor never keeps a connection from the relay.
        let n = {
            let mut conn = crate::checkout(pool).await?;
            outbox.purge_batch(&mut conn, sql, age, BATCH).await?
        };
        total += n;
        if n < BATCH as u64 {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}
