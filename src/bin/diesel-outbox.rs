//! `diesel-outbox`: migrate, inspect, redrive, purge and relay an outbox from the shell.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection};
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Error, Outbox, PgPool};
use futures_util::FutureExt;
use serde_json::json;

/// Exit codes: 0 success, 1 other failure, 2 usage error, 3 connection failure, 4 table not
/// migrated.
const USAGE: u8 = 2;
const CONNECTION: u8 = 3;
const NOT_MIGRATED: u8 = 4;

#[derive(Parser)]
#[command(
    name = "diesel-outbox",
    version,
    about = "Operate a diesel-outbox table: migrate, inspect, redrive, purge, relay.",
    after_help = "Exit codes: 0 success, 1 failure, 2 usage error, 3 connection failure \
                  (database or broker), 4 table not migrated."
)]
struct Cli {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,

    /// Outbox table: `name` or `schema.name`.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "outbox", global = true)]
    table: String,

    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the outbox and inbox tables (safe to run on every start).
    Migrate,
    /// Print the schema statements, or write them as diesel CLI migration folders.
    Sql {
        /// Write one `<DIR>/<timestamp>_<name>/{up,down}.sql` per schema version instead of
        /// printing.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Only this schema version (for an app that has the earlier ones already).
        #[arg(long)]
        version: Option<usize>,
    },
    /// Show pending, in-flight, sent and dead counts and the lag.
    Stats,
    /// List dead letters with their last error.
    Dead {
        /// How many to list, oldest first.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Make dead letters pending again (all of them when no key is given).
    Redrive {
        /// Idempotency keys to redrive.
        keys: Vec<String>,
    },
    /// Delete old sent rows and inbox (dedupe) records.
    Purge {
        /// Delete sent rows older than this (e.g. `7d`, `12h`); `off` keeps them.
        #[arg(long, default_value = "7d", value_parser = parse_age, allow_hyphen_values = true)]
        sent_older_than: Age,
        /// Delete inbox records older than this; `off` keeps them.
        #[arg(long, default_value = "30d", value_parser = parse_age, allow_hyphen_values = true)]
        inbox_older_than: Age,
    },
    /// Run a relay to RabbitMQ until SIGINT or SIGTERM, then drain and exit.
    Relay(RelayArgs),
}

#[derive(Args)]
struct RelayArgs {
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    amqp_url: String,
    /// Exchange to publish to (must exist).
    #[arg(long, env = "OUTBOX_EXCHANGE")]
    exchange: String,
    /// Rows claimed per cycle.
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Publishes in flight for one-by-one publishing.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Claim lease.
    #[arg(long, default_value = "30s", value_parser = parse_duration, allow_hyphen_values = true)]
    lease: Duration,
    /// Poll interval when not woken.
    #[arg(long, default_value = "2s", value_parser = parse_duration, allow_hyphen_values = true)]
    poll_interval: Duration,
    /// Attempts before a message is dead-lettered.
    #[arg(long, default_value_t = 10)]
    max_attempts: u32,
    /// Smallest retry backoff.
    #[arg(long, default_value = "1s", value_parser = parse_duration, allow_hyphen_values = true)]
    backoff_min: Duration,
    /// Largest retry backoff.
    #[arg(long, default_value = "5m", value_parser = parse_duration, allow_hyphen_values = true)]
    backoff_max: Duration,
    /// How long publishes under way may finish on shutdown.
    #[arg(long, default_value = "10s", value_parser = parse_duration, allow_hyphen_values = true)]
    drain_timeout: Duration,
    /// Poll only; do not LISTEN for wake-ups.
    #[arg(long)]
    without_notify: bool,
    /// Purge sent rows older than this; `off` keeps them.
    #[arg(long, default_value = "7d", value_parser = parse_age, allow_hyphen_values = true)]
    retention: Age,
    /// Purge inbox records older than this; `off` keeps them.
    #[arg(long, default_value = "30d", value_parser = parse_age, allow_hyphen_values = true)]
    inbox_retention: Age,
    /// Broker confirm timeout per batch.
    #[arg(long, default_value = "10s", value_parser = parse_duration, allow_hyphen_values = true)]
    confirm_timeout: Duration,
    /// The most payload and header bytes one claim takes (at least one row) [default:
    /// the library's, 16 MiB].
    #[arg(long)]
    max_batch_bytes: Option<usize>,
    /// Database connections in the relay's pool (plus one for LISTEN).
    #[arg(long, default_value_t = 4)]
    pool_size: u32,
}

/// An age, or `off`.
#[derive(Clone, Copy)]
struct Age(Option<Duration>);

fn parse_duration(s: &str) -> Result<Duration, String> {
    if s.trim_start().starts_with('-') {
        return Err("a negative duration is not allowed".into());
    }
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 500ms, 30s, 12h, 7d)"))
}

fn parse_age(s: &str) -> Result<Age, String> {
    if s == "off" {
        return Ok(Age(None));
    }
    parse_duration(s).map(|d| Age(Some(d)))
}

/// A failure with its exit code; its message never holds a URL or password.
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
            Error::Pool(_) | Error::Publish(_) => CONNECTION,
            e if e.is_invalid_input() => USAGE,
            _ => 1,
        };
        Failure::new(code, err.to_string())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let secrets = secrets(&cli);
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("error: {}", redact(&failure.message, &secrets));
            ExitCode::from(failure.code)
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let outbox = Outbox::builder().table(&cli.table).build()?;
    if let Command::Sql { dir, version } = &cli.command {
        return sql(&outbox, dir.as_deref(), *version, cli.json);
    }
    let url = cli.database_url.clone().ok_or_else(|| {
        Failure::new(
            USAGE,
            "no database: pass --database-url or set DATABASE_URL",
        )
    })?;
    let mut conn = AsyncPgConnection::establish(&url)
        .await
        .map_err(|e| Failure::new(CONNECTION, format!("cannot connect to the database: {e}")))?;
    match cli.command {
        Command::Migrate => {
            outbox.migrate(&mut conn).await?;
            print(
                cli.json,
                json!({ "table": outbox.table(), "migrated": true }),
                || format!("{} is migrated", outbox.table()),
            );
        }
        Command::Stats => stats(&outbox, &mut conn, cli.json).await?,
        Command::Dead { limit } => dead(&outbox, &mut conn, limit, cli.json).await?,
        Command::Redrive { keys } => {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let redriven = outbox.redrive(&mut conn, &keys).await?;
            print(cli.json, json!({ "redriven": redriven }), || {
                let mut out = format!("redrove {} dead letter(s)", redriven.len());
                for key in &redriven {
                    out.push_str(&format!("\n  {key}"));
                }
                out
            });
        }
        Command::Purge {
            sent_older_than,
            inbox_older_than,
        } => {
            purge(
                &outbox,
                &mut conn,
                sent_older_than,
                inbox_older_than,
                cli.json,
            )
            .await?
        }
        Command::Relay(args) => {
            drop(conn);
            relay(&outbox, &url, args).await?;
        }
        Command::Sql { .. } => unreachable!("handled above"),
    }
    Ok(())
}

fn print(json: bool, value: serde_json::Value, human: impl FnOnce() -> String) {
    if json {
        println!("{value}");
    } else {
        println!("{}", human());
    }
}

fn sql(
    outbox: &Outbox,
    dir: Option<&std::path::Path>,
    version: Option<usize>,
    json: bool,
) -> Result<(), Failure> {
    let migrations = outbox.diesel_migrations();
    if let Some(v) = version
        && !(1..=migrations.len()).contains(&v)
    {
        return Err(Failure::new(
            USAGE,
            format!(
                "--version {v}: this crate knows versions 1 to {}",
                migrations.len()
            ),
        ));
    }
    let chosen: Vec<(usize, &(String, String))> = (1..)
        .zip(&migrations)
        .filter(|(v, _)| version.is_none_or(|wanted| wanted == *v))
        .collect();
    let Some(dir) = dir else {
        let statements = if version.is_none() {
            outbox.sql()
        } else {
            chosen.iter().map(|(_, (up, _))| up.clone()).collect()
        };
        print(json, json!({ "statements": statements }), || {
            chosen
                .iter()
                .map(|(_, (up, _))| up.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        });
        return Ok(());
    };
    // One folder per schema version, named so that the diesel CLI applies them in order.
    let now = chrono::Utc::now();
    let table = outbox.table().replace('.', "_");
    let mut written = Vec::new();
    for (version, (up, down)) in chosen {
        let at = now + chrono::Duration::seconds(i64::try_from(version).unwrap_or(0) - 1);
        let name = if version == 1 {
            format!("{}_create_{table}", at.format("%Y-%m-%d-%H%M%S"))
        } else {
            format!("{}_{table}_v{version}", at.format("%Y-%m-%d-%H%M%S"))
        };
        let folder = dir.join(name);
        std::fs::create_dir_all(&folder)
            .and_then(|()| std::fs::write(folder.join("up.sql"), up))
            .and_then(|()| std::fs::write(folder.join("down.sql"), down))
            .map_err(|e| Failure::new(1, format!("cannot write {}: {e}", folder.display())))?;
        written.push(folder);
    }
    print(json, json!({ "migrations": written }), || {
        written
            .iter()
            .map(|f| format!("wrote {}", f.display()))
            .collect::<Vec<_>>()
            .join("\n")
    });
    Ok(())
}

async fn stats(outbox: &Outbox, conn: &mut AsyncPgConnection, json: bool) -> Result<(), Failure> {
    let s = outbox.stats(conn).await?;
    let lag = s.oldest_pending.map(|d| d.as_secs_f64());
    print(
        json,
        json!({
            "table": outbox.table(),
            "pending": s.pending,
            "in_flight": s.in_flight,
            "sent": s.sent,
            "sent_is_estimate": s.sent_is_estimate,
            "dead": s.dead,
            "lag_seconds": lag,
        }),
        || {
            let mut table = Table::new();
            table.load_preset(UTF8_FULL_CONDENSED).set_header([
                "table",
                "pending",
                "in flight",
                "sent",
                "dead",
                "lag",
            ]);
            let sent = if s.sent_is_estimate {
                format!("~{}", s.sent)
            } else {
                s.sent.to_string()
            };
            table.add_row([
                outbox.table().to_owned(),
                s.pending.to_string(),
                s.in_flight.to_string(),
                sent,
                s.dead.to_string(),
                lag.map_or("-".to_owned(), |l| format!("{l:.1}s")),
            ]);
            table.to_string()
        },
    );
    Ok(())
}

async fn dead(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    limit: u32,
    json: bool,
) -> Result<(), Failure> {
    let letters = outbox.dead_letters(conn, limit).await?;
    let rows: Vec<serde_json::Value> = letters
        .iter()
        .map(|d| {
            json!({
                "key": d.key,
                "topic": d.topic,
                "aggregate_key": d.aggregate_key,
                "attempts": d.attempts,
                "last_error": d.last_error,
                "created_at": d.created_at,
                "dead_at": d.dead_at,
            })
        })
        .collect();
    print(json, json!({ "dead_letters": rows }), || {
        if letters.is_empty() {
            return "no dead letters".to_owned();
        }
        let mut table = Table::new();
        table.load_preset(UTF8_FULL_CONDENSED).set_header([
            "key",
            "topic",
            "attempts",
            "dead at",
            "last error",
        ]);
        for d in &letters {
            table.add_row([
                d.key.clone(),
                d.topic.clone(),
                d.attempts.to_string(),
                d.dead_at.map_or("-".to_owned(), |t| {
                    t.format("%Y-%m-%d %H:%M:%S").to_string()
                }),
                d.last_error.clone().unwrap_or_default(),
            ]);
        }
        table.to_string()
    });
    Ok(())
}

async fn purge(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    sent: Age,
    inbox: Age,
    json: bool,
) -> Result<(), Failure> {
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.enable_steady_tick(Duration::from_millis(100));
    let mut purged_sent = 0;
    let mut purged_inbox = 0;
    if let Age(Some(age)) = sent {
        spinner.set_message("purging sent rows");
        purged_sent = outbox.purge_sent(conn, age).await?;
    }
    if let Age(Some(age)) = inbox {
        spinner.set_message(format!(
            "purged {purged_sent} sent rows; purging inbox records"
        ));
        purged_inbox = outbox.purge_inbox(conn, age).await?;
    }
    spinner.finish_and_clear();
    print(
        json,
        json!({ "sent_rows": purged_sent, "inbox_records": purged_inbox }),
        || format!("purged {purged_sent} sent row(s) and {purged_inbox} inbox record(s)"),
    );
    Ok(())
}

async fn relay(outbox: &Outbox, database_url: &str, args: RelayArgs) -> Result<(), Failure> {
    tracing_subscriber::fmt()
        .with_env_filter(log_filter(std::env::var("RUST_LOG").ok().as_deref()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // Installed before anything else, so a signal during start-up stops the process cleanly
    // too (rather than killing it).
    let shutdown = shutdown_signal().shared();
    let relay = tokio::select! {
        relay = start_relay(outbox, database_url, &args) => relay?,
        () = shutdown.clone() => return Ok(()),
    };
    relay.run_until(shutdown).await?;
    Ok(())
}

/// Connects to the database and the broker and builds the relay.
async fn start_relay(
    outbox: &Outbox,
    database_url: &str,
    args: &RelayArgs,
) -> Result<diesel_outbox::Relay<RabbitMqPublisher>, Failure> {
    let pool = PgPool::builder()
        .max_size(args.pool_size.max(1))
        .test_on_check_out(false)
        .build(AsyncDieselConnectionManager::new(database_url))
        .await
        .map_err(|e| Failure::new(CONNECTION, format!("cannot build the pool: {e}")))?;
    // Fail fast when the table is missing rather than on the first cycle.
    {
        let mut conn = pool.get().await.map_err(Error::from)?;
        outbox.stats(&mut conn).await?;
    }
    let publisher = RabbitMqPublisher::builder(&args.amqp_url, &args.exchange)
        .confirm_timeout(args.confirm_timeout)
        .connect()
        .await?;
    let mut builder = outbox
        .relay(pool, publisher)
        .batch_size(args.batch_size)
        .concurrency(args.concurrency)
        .lease(args.lease)
        .poll_interval(args.poll_interval)
        .max_attempts(args.max_attempts)
        .backoff(args.backoff_min, args.backoff_max)
        .drain_timeout(args.drain_timeout)
        .retention(args.retention.0)
        .inbox_retention(args.inbox_retention.0);
    if args.without_notify {
        builder = builder.without_listen();
    }
    if let Some(bytes) = args.max_batch_bytes {
        builder = builder.max_batch_bytes(bytes);
    }
    Ok(builder.build()?)
}

/// Targets of dependencies that log payloads or credentials, and the most they may log:
/// lapin logs returned messages (payload included) at warn and every frame (the login's
/// password included) at trace; amq-protocol logs the broker URL at trace; tokio-postgres
/// logs bound parameters (payloads) at debug.
const QUIET: &[(&str, &str)] = &[
    ("lapin", "error"),
    ("amq_protocol", "info"),
    ("tokio_postgres", "info"),
];

/// `RUST_LOG` (or `info`), with [`QUIET`]'s directives added for every target it does not
/// name itself.
fn log_filter(rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    let spec = rust_log.filter(|s| !s.trim().is_empty()).unwrap_or("info");
    const LEVELS: &[&str] = &["trace", "debug", "info", "warn", "error", "off"];
    // A directive names a target when it is `target`, `target=level` or `target[span]=..`.
    let named = |target: &str| {
        spec.split(',').any(|directive| {
            let directive = directive.trim();
            let name = match directive.split_once('=') {
                Some((name, _)) => name,
                None if LEVELS.contains(&directive.to_ascii_lowercase().as_str()) => return false,
                None => directive,
            };
            let name = name.split('[').next().unwrap_or_default().trim();
            !name.is_empty() && (name.starts_with(target) || target.starts_with(name))
        })
    };
    let mut directives = vec![spec.to_owned()];
    for (target, level) in QUIET {
        if !named(target) {
            directives.push(format!("{target}={level}"));
        }
    }
    tracing_subscriber::EnvFilter::try_new(directives.join(",")).unwrap_or_else(|_| {
        let mut fallback = vec!["info".to_owned()];
        fallback.extend(QUIET.iter().map(|(t, l)| format!("{t}={l}")));
        tracing_subscriber::EnvFilter::new(fallback.join(","))
    })
}

/// Completes on SIGINT or SIGTERM. The handlers are installed when this is called, not when
/// the future is first polled.
fn shutdown_signal() -> futures_util::future::BoxFuture<'static, ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        Box::pin(async move {
            match (interrupt, terminate) {
                (Ok(mut interrupt), Ok(mut terminate)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
            tracing::info!("shutdown signal received");
        })
    }
    #[cfg(not(unix))]
    {
        Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutdown signal received");
        })
    }
}

/// Secrets to scrub from any message: the URLs and their passwords.
fn secrets(cli: &Cli) -> Vec<String> {
    let mut urls = vec![cli.database_url.clone()];
    if let Command::Relay(args) = &cli.command {
        urls.push(Some(args.amqp_url.clone()));
    }
    let mut out = Vec::new();
    for url in urls.into_iter().flatten() {
        if let Some(password) = password(&url) {
            out.push(password);
        }
        out.push(url);
    }
    out.retain(|s| !s.is_empty());
    // Longest first, so a URL is replaced whole before its password.
    out.sort_by_key(|s| std::cmp::Reverse(s.len()));
    out
}

fn password(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split('/').next()?.rsplit_once('@')?.0;
    Some(userinfo.split_once(':')?.1.to_owned())
}

fn redact(message: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .fold(message.to_owned(), |m, s| m.replace(s.as_str(), "***"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(rust_log: Option<&str>) -> String {
        log_filter(rust_log).to_string()
    }

    #[test]
    fn the_quiet_targets_are_added_unless_named() {
        for spec in [
            None,
            Some(""),
            Some("info"),
            Some("trace"),
            Some("diesel_outbox=trace"),
        ] {
            let filter = shown(spec);
            for (target, level) in QUIET {
                assert!(
                    filter.contains(&format!("{target}={level}")),
                    "{spec:?}: {filter}"
                );
            }
        }
        let named = shown(Some("trace,lapin=debug"));
        assert!(
            named.contains("lapin=debug") && !named.contains("lapin=error"),
            "{named}"
        );
        assert!(named.contains("tokio_postgres=info"), "{named}");
    }
}
