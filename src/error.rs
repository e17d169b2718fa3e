//! The crate's one error type.

use std::error::Error as StdError;

/// A boxed error from a publisher, a pool or another source outside the crate.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Everything that can go wrong in this crate.
///
/// Messages never contain payloads, URLs or passwords: they name messages by idempotency
/// key and topic only. A message says its causes itself, each once, and no variant has a
/// [`source`](std::error::Error::source): a reporter that walks sources (`anyhow`'s
/// `{:?}`, say) prints the chain once, not again under "Caused by".
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The table name is not `name` or `schema.name` with parts `[a-z_][a-z0-9_]*`, or one of
    /// the identifiers derived from it would exceed PostgreSQL's 63-byte limit.
    #[error("invalid outbox table name: {0}")]
    InvalidTable(String),

    /// A message (or a dedupe call's consumer or key) was rejected before any SQL ran.
    #[error("invalid input: {0}")]
    InvalidMessage(String),

    /// An option or builder input was rejected by `build()` (or `connect()`), or an
    /// operation's argument before any SQL ran.
    #[error("invalid option: {0}")]
    InvalidOption(String),

    /// A message with this idempotency key is already in the outbox. The caller's
    /// transaction is still usable.
    #[error("duplicate idempotency key: {}", keys.join(", "))]
    DuplicateKey {
        /// The keys that were already present.
        keys: Vec<String>,
    },

    /// An enqueue or a dedupe ran on a connection without an open transaction: the event
    /// (or the dedupe record) would commit on its own, apart from the business change it
    /// belongs with, which defeats the outbox. Nothing was written. Open a transaction
    /// (`conn.transaction(..)`), even for a write of the event alone.
    #[error(
        "{0} needs an open transaction: run it inside conn.transaction(..), so that it commits or rolls back with your change"
    )]
    NotInTransaction(&'static str),

    /// What the relay publishes to or a consumer consumes from does not exist on the broker
    /// (an exchange, a queue, a JetStream stream for the subject prefix, a durable
    /// consumer): found when the publisher connects or the consumer starts, where no retry
    /// would mend it. Declare it (the brokers' `Topology`, or `diesel-outbox declare`), or
    /// fix the name. Once running, a destination that disappears is an outage instead (a
    /// broker restart can drop one for a while).
    #[error("{0}")]
    NotDeclared(String),

    /// The outbox table does not exist.
    #[error("outbox table {table} is missing: run `migrate` first")]
    NotMigrated {
        /// The table that was looked for.
        table: String,
    },

    /// The database role lacks a privilege the operation needs (the crate docs list the
    /// grants of each role under "Privileges"). Like every SQL error it aborts an open
    /// transaction.
    #[error("permission denied on {table}: this needs {needs}")]
    PermissionDenied {
        /// The outbox table the operation ran on.
        table: String,
        /// The grants the operation needs.
        needs: String,
    },

    /// A database error.
    #[error("database error: {}", crate::connect::chain(.0))]
    Database(diesel::result::Error),

    /// Checking a connection out of the pool failed.
    #[error("connection pool error: {}", crate::connect::chain(&**.0))]
    Pool(BoxError),

    /// Applying the outbox migrations failed.
    #[error("migration failed: {}", crate::connect::chain(&**.0))]
    Migration(BoxError),

    /// A broker failed in a way that stops the caller: at start-up (a publisher's connect,
    /// a consumer source's) or while declaring a topology. The message is the broker's
    /// failure itself ("broker unavailable: Kafka at …: …"), naming the broker and the
    /// cause once; [`Error::publish_error`] gives the
    /// [`PublishError`](crate::PublishError), where there is one, for its kind.
    #[error("{}", crate::connect::chain(&**.0))]
    Publish(BoxError),
}

impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        Error::Database(e)
    }
}

impl Error {
    /// The broker's failure behind an [`Error::Publish`], where it is a
    /// [`PublishError`](crate::PublishError): whether it was an outage, a permanent or a
    /// transient failure.
    pub fn publish_error(&self) -> Option<&crate::PublishError> {
        match self {
            Error::Publish(e) => e.downcast_ref(),
            _ => None,
        }
    }

    /// True for [`Error::DuplicateKey`].
    pub fn is_duplicate_key(&self) -> bool {
        matches!(self, Error::DuplicateKey { .. })
    }

    /// True for the input errors that are rejected before any SQL runs.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::InvalidTable(_) | Error::InvalidMessage(_) | Error::InvalidOption(_)
        )
    }

    /// True for a failure a database restart or outage explains, one a later try may find
    /// gone: no connection could be had (refused, no answer, the server starting up or
    /// shutting down), or the connection was closed under the statement ("terminating
    /// connection due to administrator command"). False for what no retry mends: a
    /// malformed URL, a refused login, a database or role that does not exist, a
    /// certificate that does not verify, and every error of the statement itself.
    pub fn is_connection(&self) -> bool {
        use diesel::result::{DatabaseErrorKind, Error as DieselError};
        match self {
            Error::Pool(e) => !crate::connect::permanent(&e.to_string()),
            Error::Database(DieselError::DatabaseError(
                DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand,
                _,
            )) => true,
            // 57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now; diesel
            // does not expose the SQLSTATE, so match the text.
            Error::Database(DieselError::DatabaseError(_, info)) => {
                let message = info.message();
                message.starts_with("terminating connection")
                    || message.starts_with("the database system is")
                    || message.contains("server closed the connection")
                    || message.contains("connection closed")
            }
            _ => false,
        }
    }

    pub(crate) fn invalid_message(msg: impl Into<String>) -> Self {
        Error::InvalidMessage(msg.into())
    }

    /// An [`Error::InvalidOption`].
    pub(crate) fn invalid_option(msg: impl Into<String>) -> Self {
        Error::InvalidOption(msg.into())
    }

    /// Maps PostgreSQL's "relation does not exist" to [`Error::NotMigrated`] and
    /// "permission denied" to [`Error::PermissionDenied`] (naming `needs`).
    pub(crate) fn from_db(err: diesel::result::Error, table: &str, needs: &str) -> Self {
        use diesel::result::{DatabaseErrorKind, Error as DieselError};
        if let DieselError::DatabaseError(DatabaseErrorKind::Unknown, info) = &err {
            // 42P01 undefined_table and 42501 insufficient_privilege; diesel does not
            // expose the SQLSTATE, so match the text.
            let message = info.message();
            // A relation, or a column a later schema version added: migrate.
            if message.contains("does not exist")
                && (message.contains("relation") || message.starts_with("column"))
            {
                return Error::NotMigrated {
                    table: table.to_owned(),
                };
            }
            if message.starts_with("permission denied") {
                return Error::PermissionDenied {
                    table: table.to_owned(),
                    needs: needs.to_owned(),
                };
            }
        }
        Error::Database(err)
    }
}

impl<E> From<bb8::RunError<E>> for Error
where
    E: StdError + Send + Sync + 'static,
{
    fn from(err: bb8::RunError<E>) -> Self {
        Error::Pool(Box::new(err))
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use std::fmt;

    use super::*;
    use crate::publisher::PublishError;

    /// An error whose message repeats its source's, as many libraries' do.
    #[derive(Debug)]
    struct Wrapping(std::io::Error);

    impl fmt::Display for Wrapping {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "IO error: {}", self.0)
        }
    }

    impl StdError for Wrapping {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_brokers_failure_reads_as_what_it_is_with_each_cause_once() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused here");
        let err = Error::Publish(PublishError::unavailable(Wrapping(refused)).into());
        let text = err.to_string();
        assert_eq!(text, "broker unavailable: IO error: refused here");
        assert!(!text.contains("publish failed"), "{text}");
        // Reporters that walk sources (anyhow's "Caused by") find none to say again.
        assert!(err.source().is_none());
        assert!(err.publish_error().is_some_and(|p| p.is_unavailable()));
        let pool = Error::Pool(Box::new(Wrapping(std::io::Error::other("reset"))));
        assert_eq!(pool.to_string(), "connection pool error: IO error: reset");
        assert!(pool.source().is_none());
        let declared = Error::Publish("NATS at 127.0.0.1:4222: timed out".into());
        assert_eq!(declared.to_string(), "NATS at 127.0.0.1:4222: timed out");
    }
}
