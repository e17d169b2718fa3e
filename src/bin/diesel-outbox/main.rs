//! `diesel-outbox`: migrate, inspect, redrive, discard, purge and relay an outbox from the shell.
//!
//! One file per group of subcommands (`schema`: migrate and sql; `ops`: stats, dead,
//! redrive, discard, purge; `relay`), durations and ages in `durations`, histogram buckets
//! in `buckets`, redaction of every URL-valued argument in `secret`, and output through any
//! writer in `output`.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod broker;
mod buckets;
mod durations;
mod logs;
mod ops;
mod output;
mod relay;
mod schema;
mod secret;
mod serve;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use diesel_outbox::{Error, Outbox};

use crate::output::Output;
use crate::secret::{Secret, Secrets};

/// Exit codes: 0 success, 1 other failure, 2 usage error, 3 connection failure, 4 table not
/// migrated, 5 a broker destination missing.
const USAGE: u8 = 2;
const CONNECTION: u8 = 3;
const NOT_MIGRATED: u8 = 4;
const NOT_DECLARED: u8 = 5;

#[derive(Parser)]
#[command(
    name = "diesel-outbox",
    version,
    about = "Operate a diesel-outbox table: migrate, inspect, redrive, purge, relay.",
    after_help = "Exit codes: 0 success, 1 failure, 2 usage error, 3 connection failure \
                  (database or broker), 4 table not migrated, 5 an exchange, queue, stream \
                  or durable consumer missing on the broker (see `declare`)."
)]
struct Cli {
    /// PostgreSQL URL, with libpq's TLS parameters if need be (`sslmode`, `sslrootcert`,
    /// `sslcert`, `sslkey`; `sslmode=prefer` by default).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<Secret>,

    /// A file holding the PostgreSQL URL (a container secret, say), instead of
    /// `--database-url`.
    #[arg(
        long,
        env = "DATABASE_URL_FILE",
        global = true,
        value_name = "PATH",
        value_parser = secret::read_file
    )]
    database_url_file: Option<Secret>,

    /// Turn off the prepared statement cache, for a pooler in transaction mode that cannot
    /// track prepared statements (PgBouncer before 1.21). `relay` uses it for its pool too,
    /// but belongs on a direct connection to PostgreSQL: its LISTEN needs a session of its
    /// own, which `--without-listen` does without (polling instead).
    #[arg(
        long,
        env = "OUTBOX_NO_STATEMENT_CACHE",
        global = true,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    no_statement_cache: bool,

    /// Outbox table: `name` or `schema.name`.
    #[arg(long, env = "OUTBOX_TABLE", default_value = diesel_outbox::defaults::TABLE, global = true)]
    table: String,

    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,

    /// How log lines on stderr are written: `text`, or `json` (one object per line).
    #[arg(long, value_enum, default_value_t = logs::LogFormat::Text, env = "OUTBOX_LOG_FORMAT", global = true)]
    log_format: logs::LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the outbox and inbox tables (safe to run on every start).
    Migrate(schema::MigrateArgs),
    /// Print the schema statements, or write them as diesel CLI migration folders.
    Sql(schema::SqlArgs),
    /// Show pending, in-flight, sent and dead counts and the lag.
    Stats(ops::StatsArgs),
    /// List dead letters with their last error.
    Dead(ops::DeadArgs),
    /// Make dead letters pending again: those with the keys given (every key must be a
    /// dead letter, or nothing changes), or all of them with `--all`.
    Redrive(ops::KeysArgs),
    /// Delete dead letters for good (a message that no redrive can deliver): those with the
    /// keys given (every key must be a dead letter, or nothing changes), or all of them
    /// with `--all`.
    Discard(ops::KeysArgs),
    /// Delete old sent rows and inbox (dedupe) records.
    Purge(ops::PurgeArgs),
    /// Run a relay to RabbitMQ, NATS JetStream or Kafka until SIGINT or SIGTERM, then drain
    /// and exit.
    Relay(Box<relay::RelayArgs>),
    /// Declare what the relay and its consumers need on the broker (RabbitMQ: the exchange,
    /// queues and their dead letters; NATS: the stream and durable consumers; Kafka: the
    /// topics and their partitions); safe to run again.
    Declare(Box<broker::DeclareArgs>),
}

impl Cli {
    /// Each secret given both as a value and as a file, settled (see [`secret::pick`]).
    fn resolve(mut self, matches: &clap::ArgMatches) -> Result<Self, String> {
        self.database_url = secret::pick(
            matches,
            ("database_url", self.database_url.take()),
            ("database_url_file", self.database_url_file.take()),
        )?;
        match (&mut self.command, matches.subcommand()) {
            (Command::Relay(args), Some(("relay", sub))) => args.broker.resolve(sub)?,
            (Command::Declare(args), Some(("declare", sub))) => args.broker.resolve(sub)?,
            _ => {}
        }
        Ok(self)
    }
}

/// A failure with its exit code; its message is redacted before it is printed.
#[derive(Debug)]
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl From<Error> for Failure {
    fn from(err: Error) -> Self {
        let code = match &err {
            Error::NotMigrated { .. } => NOT_MIGRATED,
            Error::NotDeclared(_) => NOT_DECLARED,
            Error::Pool(_) | Error::Publish(_) => CONNECTION,
            e if e.is_invalid_input() => USAGE,
            _ => 1,
        };
        // The crate's errors say each cause once in their message, and have no source.
        Failure::new(code, err.to_string())
    }
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let secrets = Secrets::of(&matches);
    let cli = match Cli::from_arg_matches(&matches).map(|cli| cli.resolve(&matches)) {
        Ok(Ok(cli)) => cli,
        Ok(Err(message)) => {
            eprintln!("error: {message}");
            return ExitCode::from(USAGE);
        }
        Err(e) => e.exit(),
    };
    // The relay tells what it does; one-shot commands print their output, and only
    // warnings and errors on stderr.
    let default_level = if matches!(cli.command, Command::Relay(_)) {
        "info"
    } else {
        "warn"
    };
    logs::init(cli.log_format, default_level);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout();
    let result = runtime.block_on(run(cli, &mut stdout, std::io::stdout().is_terminal()));
    ExitCode::from(report(result, &secrets, &mut std::io::stderr()))
}

/// Prints a failure, redacted, and returns the exit code.
fn report(result: Result<(), Failure>, secrets: &Secrets, stderr: &mut dyn Write) -> u8 {
    match result {
        Ok(()) => 0,
        Err(failure) => {
            let _ = writeln!(stderr, "error: {}", secrets.redact(&failure.message));
            failure.code
        }
    }
}

/// Runs one command, writing its output to `out` (a terminal, whose screen `stats --watch`
/// clears before each redraw, when `terminal`).
async fn run(cli: Cli, out: &mut dyn Write, terminal: bool) -> Result<(), Failure> {
    let outbox = Outbox::builder().table(&cli.table).build()?;
    let mut output = Output::new(cli.json, out, terminal);
    if let Command::Sql(args) = &cli.command {
        return schema::sql(&outbox, args, &mut output);
    }
    if let Command::Declare(args) = cli.command {
        return broker::declare(*args, &mut output).await;
    }
    let url = cli.database_url.ok_or_else(|| {
        Failure::new(
            USAGE,
            "no database: pass --database-url or --database-url-file, or set DATABASE_URL \
             or DATABASE_URL_FILE",
        )
    })?;
    if let Command::Relay(args) = cli.command {
        // The relay waits for the database up to its `--connect-timeout` (a restart, or a
        // server not up yet, at deploy time) and then fails with the cause.
        return relay::run(&outbox, &url, cli.no_statement_cache, *args).await;
    }
    // Every other command fails at once on a database it cannot reach, with the cause.
    let connecting = if cli.no_statement_cache {
        diesel_outbox::establish_without_statement_cache(url.expose()).await
    } else {
        diesel_outbox::establish(url.expose()).await
    };
    let mut conn = connecting.map_err(|e| {
        let code = match e {
            diesel::ConnectionError::InvalidConnectionUrl(_) => USAGE,
            _ => CONNECTION,
        };
        Failure::new(code, format!("cannot connect to the database: {e}"))
    })?;
    match cli.command {
        Command::Migrate(args) => schema::migrate(&outbox, &mut conn, &args, &mut output).await,
        Command::Stats(args) => ops::stats(&outbox, &mut conn, args, &mut output).await,
        Command::Dead(args) => ops::dead(&outbox, &mut conn, args, &mut output).await,
        Command::Redrive(args) => ops::redrive(&outbox, &mut conn, args, &mut output).await,
        Command::Discard(args) => ops::discard(&outbox, &mut conn, args, &mut output).await,
        Command::Purge(args) => ops::purge(&outbox, &mut conn, args, &mut output).await,
        Command::Sql(_) | Command::Relay(_) | Command::Declare(_) => {
            unreachable!("handled above")
        }
    }
}

/// The binary's commands run in process, against the local database.
#[cfg(test)]
mod tests {
    use diesel_async::{AsyncConnection, AsyncPgConnection};

    use super::*;

    /// Runs the CLI in process as the binary would, returning its exit code, stdout and
    /// stderr.
    /// `DATABASE_URL`, or the local test database.
    fn database_url() -> String {
        std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
    }

    pub(crate) async fn cli(args: &[&str]) -> (u8, String, String) {
        let database = database_url();
        let argv = ["diesel-outbox", "--database-url", &database]
            .into_iter()
            .chain(args.iter().copied());
        let matches = Cli::command()
            .try_get_matches_from(argv)
            .expect("valid arguments");
        let secrets = Secrets::of(&matches);
        let cli = Cli::from_arg_matches(&matches)
            .unwrap()
            .resolve(&matches)
            .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = report(run(cli, &mut out, false).await, &secrets, &mut err);
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    fn unique(prefix: &str) -> String {
        format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
    }

    #[tokio::test]
    async fn migrate_stats_dead_redrive_and_purge_in_process() {
        let schema = unique("cli");
        let table = format!("{schema}.events");
        let (code, out, err) = cli(&["--table", &table, "migrate", "--json"]).await;
        assert_eq!(code, 0, "{err}");
        let migrated: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(migrated["migrated"], true);

        let (code, out, _) = cli(&["--table", &table, "stats"]).await;
        assert_eq!(code, 0);
        assert!(out.contains("pending") && out.contains(&table), "{out}");

        let (code, out, _) = cli(&["--table", &table, "dead"]).await;
        assert_eq!(code, 0);
        assert_eq!(out.trim(), "no dead letters");

        let (code, out, _) = cli(&["--table", &table, "redrive", "--all", "--json"]).await;
        assert_eq!(code, 0);
        assert_eq!(out.trim(), r#"{"redriven":[]}"#);

        let (code, out, _) = cli(&["--table", &table, "discard", "--all", "--json"]).await;
        assert_eq!(code, 0);
        assert_eq!(out.trim(), r#"{"discarded":0}"#);

        let (code, out, _) = cli(&["--table", &table, "purge", "--json"]).await;
        assert_eq!(code, 0);
        assert_eq!(out.trim(), r#"{"inbox_records":0,"sent_rows":0}"#);

        let (code, _, err) = cli(&["--table", &format!("{schema}.missing"), "stats"]).await;
        assert_eq!(code, NOT_MIGRATED, "{err}");
        assert!(err.contains("run `migrate` first"), "{err}");

        let mut conn = AsyncPgConnection::establish(&database_url()).await.unwrap();
        diesel_async::SimpleAsyncConnection::batch_execute(
            &mut conn,
            &format!("DROP SCHEMA \"{schema}\" CASCADE"),
        )
        .await
        .unwrap();
    }

    /// A one-shot command fails at once on a database it cannot reach; the relay after its
    /// `--connect-timeout` (here 1 s, four tries), naming the host and the cause.
    #[tokio::test]
    async fn an_unreachable_database_fails_with_its_cause_and_its_password_never_reaches_stderr() {
        for (command, cause, within) in [
            (&["stats"][..], "cannot connect to the database", 5),
            (
                &[
                    "relay",
                    "--exchange",
                    "x",
                    "--amqp-url",
                    "amqp://x",
                    "--connect-timeout",
                    "1s",
                ],
                "cannot start the relay (the database at 127.0.0.1:1): the database could \
                 not be reached in ",
                6,
            ),
        ] {
            let argv = [
                "diesel-outbox",
                "--database-url",
                "postgres://postgres:hunter2@127.0.0.1:1/test",
            ]
            .into_iter()
            .chain(command.iter().copied());
            let matches = Cli::command().try_get_matches_from(argv).unwrap();
            let secrets = Secrets::of(&matches);
            let cli = Cli::from_arg_matches(&matches)
                .unwrap()
                .resolve(&matches)
                .unwrap();
            let mut err = Vec::new();
            let started = std::time::Instant::now();
            let code = report(run(cli, &mut Vec::new(), false).await, &secrets, &mut err);
            let err = String::from_utf8(err).unwrap();
            assert_eq!(code, CONNECTION, "{command:?}: {err}");
            assert!(err.contains(cause), "{command:?}: {err}");
            assert!(err.contains("127.0.0.1:1: "), "{command:?}: {err}");
            assert!(!err.contains("hunter2"), "{command:?}: {err}");
            assert!(
                started.elapsed() < std::time::Duration::from_secs(within),
                "{command:?} took {:?}",
                started.elapsed()
            );
        }
    }

    /// A broker's failure is printed as what it is, each cause once, whether the message
    /// of an error repeats its source's or not.
    #[test]
    fn a_failure_says_each_cause_once() {
        #[derive(Debug)]
        struct Silent(std::io::Error);
        impl std::fmt::Display for Silent {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("RabbitMQ at 127.0.0.1:1")
            }
        }
        impl std::error::Error for Silent {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused = || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err =
            Error::Publish(diesel_outbox::PublishError::unavailable(Silent(refused())).into());
        let mut printed = Vec::new();
        let code = report(Err(err.into()), &Secrets::default(), &mut printed);
        let printed = String::from_utf8(printed).unwrap();
        assert_eq!(code, CONNECTION);
        assert_eq!(
            printed,
            "error: broker unavailable: RabbitMQ at 127.0.0.1:1: refused\n"
        );
        let pool = Error::Pool(Box::new(Silent(refused())));
        assert_eq!(
            pool.to_string(),
            "connection pool error: RabbitMQ at 127.0.0.1:1: refused"
        );
    }

    #[test]
    fn no_statement_cache_is_off_by_default_and_takes_boolish_values_only() {
        let parse = |args: &[&str]| {
            Cli::command()
                .try_get_matches_from(["diesel-outbox"].iter().chain(args).copied())
                .map(|m| Cli::from_arg_matches(&m).unwrap().no_statement_cache)
        };
        assert!(!parse(&["stats"]).unwrap());
        assert!(parse(&["stats", "--no-statement-cache"]).unwrap());
        assert!(parse(&["--no-statement-cache", "stats"]).unwrap());
        assert!(parse(&["stats", "--no-statement-cache=yes"]).is_err());
    }

    #[tokio::test]
    async fn the_commands_run_without_the_statement_cache() {
        let schema = unique("cli");
        let table = format!("{schema}.events");
        for command in [
            &["migrate"][..],
            &["stats"],
            &["dead"],
            &["redrive", "--all"],
            &["discard", "--all"],
            &["purge"],
        ] {
            let args: Vec<&str> = ["--no-statement-cache", "--table", &table]
                .into_iter()
                .chain(command.iter().copied())
                .collect();
            let (code, _, err) = cli(&args).await;
            assert_eq!(code, 0, "{command:?}: {err}");
        }
        let mut conn = AsyncPgConnection::establish(&database_url()).await.unwrap();
        diesel_async::SimpleAsyncConnection::batch_execute(
            &mut conn,
            &format!("DROP SCHEMA \"{schema}\" CASCADE"),
        )
        .await
        .unwrap();
    }

    #[test]
    fn the_relay_defaults_are_the_librarys() {
        use diesel_outbox::defaults;
        let matches = Cli::command()
            .try_get_matches_from([
                "diesel-outbox",
                "relay",
                "--exchange",
                "x",
                "--amqp-url",
                "amqp://x",
            ])
            .unwrap();
        let Command::Relay(args) = Cli::from_arg_matches(&matches).unwrap().command else {
            panic!("relay");
        };
        assert_eq!(args.batch_size, defaults::BATCH_SIZE);
        assert_eq!(args.concurrency, defaults::CONCURRENCY);
        assert_eq!(args.lease.0, defaults::LEASE);
        assert_eq!(args.poll_interval.0, defaults::POLL_INTERVAL);
        assert_eq!(args.max_attempts, defaults::MAX_ATTEMPTS);
        assert_eq!(args.backoff_min.0, defaults::BACKOFF_MIN);
        assert_eq!(args.backoff_max.0, defaults::BACKOFF_MAX);
        assert!(
            args.drain_timeout.is_none(),
            "the library's, fitted to the lease"
        );
        assert_eq!(args.retention.0, Some(defaults::RETENTION));
        assert_eq!(args.inbox_retention.0, Some(defaults::INBOX_RETENTION));
        assert!(
            args.confirm_timeout.is_none(),
            "the publisher's, fitted to the lease"
        );
        assert_eq!(args.max_batch_bytes, defaults::MAX_BATCH_BYTES);
    }
}
