//! Connecting to PostgreSQL: libpq's TLS parameters (`sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey`) with libpq's meaning, over rustls ([`establish`]); a pool manager that uses
//! it ([`connection_manager`]); and the same without the prepared statement cache, for a
//! pooler that cannot track prepared statements
//! ([`establish_without_statement_cache`]). How the parameters are read and what each
//! mode verifies: `libpq.rs`; a start-up that waits for the database: `reach.rs`.

mod libpq;
mod reach;

pub(crate) use self::reach::permanent;
pub use self::reach::until_reachable;

use std::fmt::Write as _;

use bb8::RunError;
use diesel::ConnectionResult;
use diesel::connection::CacheSize;
use diesel::result::ConnectionError;
use diesel_async::pooled_connection::bb8::PooledConnection;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use futures_util::future::BoxFuture;
use tokio_postgres::config::Host;

/// The connection pool a relay (and the consumer runner) takes its connections from.
///
/// bb8 tests each checkout with a round trip by default; for the relay's hot path build it
/// with `.test_on_check_out(false)` (broken connections are still detected and replaced).
pub type PgPool = diesel_async::pooled_connection::bb8::Pool<AsyncPgConnection>;

/// Establishes an [`AsyncPgConnection`] to `database_url`, encrypted and verified as its
/// libpq parameters say. Multi-host URLs and `target_session_attrs` work as in
/// tokio-postgres (each host is tried in turn; TLS is verified against the host
/// connected to).
///
/// - `sslmode`: `disable` (no TLS); `prefer` (the default: TLS when the server offers it,
///   not verified); `require` (TLS or no connection; the certificate chain is verified
///   when a root certificate is given, as in libpq); `verify-ca` (the chain is verified
///   against `sslrootcert`); `verify-full` (the chain and the host name).
/// - `sslrootcert`: a PEM file of the certificate authorities to trust (default
///   `~/.postgresql/root.crt`), or `system` for the platform's trusted roots (which
///   implies, and only allows, `verify-full`).
/// - `sslcert` and `sslkey`: a client certificate and its key, PEM (default
///   `~/.postgresql/postgresql.crt` and `postgresql.key`, when they exist).
///
/// Its signature is that of `ManagerConfig::custom_setup`; [`connection_manager`] is a
/// pool manager that uses it.
///
/// # Errors
/// [`ConnectionError::InvalidConnectionUrl`] for a malformed URL, an unknown `sslmode`, or
/// a certificate or key file that is missing, unreadable or without PEM content (naming
/// the file, never the URL); [`ConnectionError::BadConnection`] naming the hosts and ports
/// tried and the cause ("connection refused", "invalid peer certificate: UnknownIssuer",
/// "server does not support TLS", "password authentication failed for user …"), never
/// the password.
pub fn establish(database_url: &str) -> BoxFuture<'_, ConnectionResult<AsyncPgConnection>> {
    Box::pin(connect(database_url))
}

/// [`establish`] with diesel-async's prepared statement cache off ([`CacheSize::Disabled`]),
/// for a pooler that cannot track prepared statements; see
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
///     "postgres://app@pgbouncer.internal:6432/app?sslmode=verify-full&sslrootcert=system",
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
/// As [`establish`].
pub fn establish_without_statement_cache(
    database_url: &str,
) -> BoxFuture<'_, ConnectionResult<AsyncPgConnection>> {
    Box::pin(async move {
        let mut conn = connect(database_url).await?;
        conn.set_prepared_statement_cache_size(CacheSize::Disabled);
        Ok(conn)
    })
}

/// A bb8 connection manager whose connections are made by [`establish`], so that a pool
/// honours the URL's `sslmode`, `sslrootcert`, `sslcert` and `sslkey`:
///
/// ```no_run
/// use diesel_outbox::{PgPool, connection_manager};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let url = "postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=system";
/// let pool: PgPool = PgPool::builder().build(connection_manager(url)).await?;
/// # let _ = pool; Ok(()) }
/// ```
pub fn connection_manager(
    database_url: impl Into<String>,
) -> AsyncDieselConnectionManager<AsyncPgConnection> {
    let mut config = ManagerConfig::default();
    config.custom_setup = Box::new(establish);
    AsyncDieselConnectionManager::new_with_config(database_url, config)
}

/// A connection out of `pool`, as `pool.get()`, with an error that says why when none
/// comes: bb8 retries a failing connect until the pool's `connection_timeout` and then
/// reports only "timed out". On that timeout this makes one connection outside the pool
/// (bounded by the same timeout) and reports its error ("cannot connect to
/// db.internal:5432: …" from [`establish`]), or, when that one succeeds, that every
/// connection of the pool was in use. The relay, the janitor and the consumer runner
/// check connections out this way.
///
/// ```no_run
/// use diesel_outbox::{PgPool, checkout, connection_manager};
///
/// # async fn run() -> Result<(), diesel_outbox::Error> {
/// let pool: PgPool = PgPool::builder()
///     .build(connection_manager("postgres://app@db.internal/app"))
///     .await
///     .map_err(|e| diesel_outbox::Error::Pool(Box::new(e)))?;
/// let conn = checkout(&pool).await?; // Error::Pool("… cannot connect to db.internal:5432: …")
/// # drop(conn); Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Pool`](crate::Error::Pool) with the cause.
pub async fn checkout(pool: &PgPool) -> crate::Result<PooledConnection<'_, AsyncPgConnection>> {
    match pool.get().await {
        Ok(conn) => Ok(conn),
        Err(RunError::User(e)) => Err(crate::Error::Pool(Box::new(e))),
        Err(RunError::TimedOut) => {
            let config = pool.config();
            let waited = config.connection_timeout;
            let why = match tokio::time::timeout(waited, pool.dedicated_connection()).await {
                Ok(Err(e)) => e.to_string(),
                Ok(Ok(_spare)) => format!(
                    "all {} connections of the pool were in use",
                    config.max_size
                ),
                Err(_) => format!("connecting took longer than {waited:?}"),
            };
            Err(crate::Error::Pool(
                format!("no connection within the pool's timeout ({waited:?}): {why}").into(),
            ))
        }
    }
}

async fn connect(database_url: &str) -> ConnectionResult<AsyncPgConnection> {
    let (rest, params) = libpq::split(database_url).map_err(invalid)?;
    let mut config: tokio_postgres::Config = rest
        .parse()
        .map_err(|e| invalid(format!("the database URL is malformed: {e}")))?;
    let choice = libpq::choose(&params).map_err(invalid)?;
    config.ssl_mode(choice.wire);
    match choice.config {
        None => match config.connect(tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                AsyncPgConnection::try_from_client_and_connection(client, connection).await
            }
            Err(e) => Err(refused(&config, &e)),
        },
        Some(tls) => {
            let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls);
            match config.connect(tls).await {
                Ok((client, connection)) => {
                    AsyncPgConnection::try_from_client_and_connection(client, connection).await
                }
                Err(e) => Err(refused(&config, &e)),
            }
        }
    }
}

fn invalid(why: String) -> ConnectionError {
    ConnectionError::InvalidConnectionUrl(why)
}

/// A failed connect, naming where it went and the whole cause chain.
fn refused(config: &tokio_postgres::Config, err: &tokio_postgres::Error) -> ConnectionError {
    let hosts = config.get_hosts();
    let ports = config.get_ports();
    let mut places = Vec::new();
    for (i, host) in hosts.iter().enumerate() {
        // One port for all hosts, or one each (tokio-postgres's rule); 5432 by default.
        let port = ports
            .get(i)
            .or_else(|| ports.first())
            .copied()
            .unwrap_or(5432);
        places.push(match host {
            Host::Tcp(name) => format!("{name}:{port}"),
            #[cfg(unix)]
            Host::Unix(dir) => format!("{}/.s.PGSQL.{port}", dir.display()),
        });
    }
    let place = if places.is_empty() {
        "PostgreSQL".to_owned()
    } else {
        places.join(", ")
    };
    let verification = if rejected_certificate(err) {
        "certificate verification failed: "
    } else {
        ""
    };
    ConnectionError::BadConnection(format!(
        "cannot connect to {place}: {verification}{}",
        chain(err)
    ))
}

/// Whether the server's certificate did not verify (rustls's error, inside the I/O error
/// of the handshake).
fn rejected_certificate(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    while let Some(e) = source {
        let tls = e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if matches!(tls, Some(rustls::Error::InvalidCertificate(_))) {
            return true;
        }
        source = e.source();
    }
    false
}

/// `%XX` escapes decoded, as in a URL's user info or parameters; `None` for a malformed
/// escape or text that is not UTF-8 once decoded.
pub(crate) fn percent_decoded(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// An error and its sources, `: `-separated, each said once.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            let _ = write!(text, ": {said}");
        }
        source = cause.source();
    }
    text
}
