//! `stats`, `dead`, `redrive` and `purge`: looking at the table and repairing it.

use std::time::Duration;

use clap::Args;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use diesel_async::AsyncPgConnection;
use diesel_outbox::Outbox;
use serde_json::json;

use crate::Failure;
use crate::durations::Age;
use crate::output::Output;

#[derive(Args)]
pub(crate) struct StatsArgs {
    /// Redraw every second until interrupted (Ctrl-C); with `--json`, one line each time.
    #[arg(long)]
    watch: bool,
    /// With `--watch`: stop after this many readings.
    #[arg(long, requires = "watch", value_parser = clap::value_parser!(u32).range(1..))]
    count: Option<u32>,
}

#[derive(Args)]
pub(crate) struct DeadArgs {
    /// How many to list, oldest first.
    #[arg(long, default_value_t = 50)]
    limit: u32,
}

#[derive(Args)]
pub(crate) struct RedriveArgs {
    /// Idempotency keys to redrive.
    keys: Vec<String>,
}

#[derive(Args)]
pub(crate) struct PurgeArgs {
    /// Delete sent rows older than this (e.g. `7d`, `12h`); `off` keeps them.
    #[arg(long, default_value_t = Age(Some(diesel_outbox::defaults::RETENTION)), allow_hyphen_values = true)]
    sent_older_than: Age,
    /// Delete inbox records older than this; `off` keeps them.
    #[arg(long, default_value_t = Age(Some(diesel_outbox::defaults::INBOX_RETENTION)), allow_hyphen_values = true)]
    inbox_older_than: Age,
}

pub(crate) async fn stats(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    args: StatsArgs,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    if !args.watch {
        return stats_once(outbox, conn, out).await;
    }
    let mut interrupted = std::pin::pin!(tokio::signal::ctrl_c());
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut readings = 0u32;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut interrupted => return Ok(()),
        }
        out.clear()?;
        // Ctrl-C also ends a reading that hangs (the database not answering).
        tokio::select! {
            read = stats_once(outbox, conn, out) => read?,
            _ = &mut interrupted => return Ok(()),
        }
        readings += 1;
        if args.count.is_some_and(|count| readings >= count) {
            return Ok(());
        }
    }
}

async fn stats_once(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    let s = outbox.stats(conn).await?;
    let lag = s.oldest_pending.map(|d| d.as_secs_f64());
    out.print(
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
    )
}

pub(crate) async fn dead(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    args: DeadArgs,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    let letters = outbox.dead_letters(conn, args.limit).await?;
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
    out.print(json!({ "dead_letters": rows }), || {
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
    })
}

pub(crate) async fn redrive(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    args: RedriveArgs,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    let keys: Vec<&str> = args.keys.iter().map(String::as_str).collect();
    let redriven = outbox.redrive(conn, &keys).await?;
    out.print(json!({ "redriven": redriven }), || {
        let mut text = format!("redrove {} dead letter(s)", redriven.len());
        for key in &redriven {
            text.push_str(&format!("\n  {key}"));
        }
        text
    })
}

pub(crate) async fn purge(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    args: PurgeArgs,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    // The spinner draws on stderr only when it is a terminal.
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.enable_steady_tick(Duration::from_millis(100));
    let mut purged_sent = 0;
    let mut purged_inbox = 0;
    if let Age(Some(age)) = args.sent_older_than {
        spinner.set_message("purging sent rows");
        purged_sent = outbox.purge_sent(conn, age).await?;
    }
    if let Age(Some(age)) = args.inbox_older_than {
        spinner.set_message(format!(
            "purged {purged_sent} sent rows; purging inbox records"
        ));
        purged_inbox = outbox.purge_inbox(conn, age).await?;
    }
    spinner.finish_and_clear();
    out.print(
        json!({ "sent_rows": purged_sent, "inbox_records": purged_inbox }),
        || format!("purged {purged_sent} sent row(s) and {purged_inbox} inbox record(s)"),
    )
}
