//! `stats`, `dead`, `redrive`, `discard` and `purge`: looking at the table and repairing it.

use std::time::Duration;

use clap::Args;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use diesel_async::AsyncPgConnection;
use diesel_outbox::{DeadLetterFilter, Outbox};
use serde_json::json;

use crate::durations::Age;
use crate::output::Output;
use crate::{Failure, USAGE};

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
    /// Only the dead letters of this topic.
    #[arg(long)]
    topic: Option<String>,
    /// Show each payload (as text when it is UTF-8, else base64). Payloads may hold
    /// personal data.
    #[arg(long)]
    show_payload: bool,
}

/// The dead letters a `redrive` or `discard` acts on: the keys given, every one of which
/// must be a dead letter, or all of them with `--all`.
#[derive(Args)]
pub(crate) struct KeysArgs {
    /// Idempotency keys of dead letters.
    #[arg(conflicts_with = "all")]
    keys: Vec<String>,
    /// Every dead letter.
    #[arg(long)]
    all: bool,
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
    let blocked = s.blocked_for.map(|d| d.as_secs_f64());
    out.print(
        json!({
            "table": outbox.table(),
            "pending": s.pending,
            "in_flight": s.in_flight,
            "sent": s.sent,
            "sent_is_estimate": s.sent_is_estimate,
            "dead": s.dead,
            "lag_seconds": lag,
            "blocked_for_seconds": blocked,
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
                "blocked for",
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
                blocked.map_or("-".to_owned(), |b| format!("{b:.1}s")),
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
    let mut filter = DeadLetterFilter::new().limit(args.limit);
    if let Some(topic) = args.topic {
        filter = filter.topic(topic);
    }
    if args.show_payload {
        filter = filter.with_payloads();
    }
    let letters = outbox.dead_letters_matching(conn, &filter).await?;
    let rows: Vec<serde_json::Value> = letters
        .iter()
        .map(|d| {
            let mut row = json!({
                "key": d.key,
                "topic": d.topic,
                "aggregate_key": d.aggregate_key,
                "attempts": d.attempts,
                "last_error": d.last_error,
                "created_at": d.created_at,
                "dead_at": d.dead_at,
            });
            if let Some(payload) = &d.payload {
                let (text, encoding) = shown(payload);
                row["payload"] = json!(text);
                row["payload_encoding"] = json!(encoding);
            }
            row
        })
        .collect();
    out.print(json!({ "dead_letters": rows }), || {
        if letters.is_empty() {
            return "no dead letters".to_owned();
        }
        let mut table = Table::new();
        let mut header = vec!["key", "topic", "attempts", "dead at", "last error"];
        if args.show_payload {
            header.push("payload");
        }
        table.load_preset(UTF8_FULL_CONDENSED).set_header(header);
        for d in &letters {
            let mut row = vec![
                d.key.clone(),
                d.topic.clone(),
                d.attempts.to_string(),
                d.dead_at.map_or("-".to_owned(), |t| {
                    t.format("%Y-%m-%d %H:%M:%S").to_string()
                }),
                d.last_error.clone().unwrap_or_default(),
            ];
            if let Some(payload) = &d.payload {
                let (text, encoding) = shown(payload);
                row.push(if encoding == "utf-8" {
                    text
                } else {
                    format!("base64:{text}")
                });
            }
            table.add_row(row);
        }
        table.to_string()
    })
}

/// A payload as text: itself when it is UTF-8, else its base64; with the encoding's name.
fn shown(payload: &[u8]) -> (String, &'static str) {
    use base64::Engine as _;
    match std::str::from_utf8(payload) {
        Ok(text) => (text.to_owned(), "utf-8"),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(payload),
            "base64",
        ),
    }
}

pub(crate) async fn redrive(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    args: KeysArgs,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    let redriven = if args.all {
        outbox.redrive(conn, &[]).await?
    } else {
        keys_given(outbox, conn, &args, "redrive").await?;
        let keys = distinct(&args.keys)?;
        all_or_nothing(conn, "redriven", &keys, async |c| {
            outbox.redrive(c, &keys).await
        })
        .await?
    };
    out.print(json!({ "redriven": redriven }), || {
        let mut text = format!("redrove {} dead letter(s)", redriven.len());
        for key in &redriven {
            text.push_str(&format!("\n  {key}"));
        }
        text
    })
}

pub(crate) async fn discard(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    args: KeysArgs,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    if args.all {
        let n = outbox.discard_all(conn).await?;
        return out.print(json!({ "discarded": n }), || {
            format!("discarded {n} dead letter(s)")
        });
    }
    keys_given(outbox, conn, &args, "discard").await?;
    let keys = distinct(&args.keys)?;
    let discarded = all_or_nothing(conn, "discarded", &keys, async |c| {
        outbox.discard(c, &keys).await
    })
    .await?;
    out.print(
        json!({ "discarded": discarded.len(), "keys": discarded }),
        || {
            let mut text = format!("discarded {} dead letter(s)", discarded.len());
            for key in &discarded {
                text.push_str(&format!("\n  {key}"));
            }
            text
        },
    )
}

/// Refuses a `redrive` or `discard` given neither keys nor `--all` (a variable that
/// expanded to nothing, say), saying how many dead letters `--all` would take.
async fn keys_given(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    args: &KeysArgs,
    verb: &str,
) -> Result<(), Failure> {
    if !args.keys.is_empty() {
        return Ok(());
    }
    let dead = outbox.stats(conn).await?.dead;
    Err(Failure::new(
        USAGE,
        format!(
            "{verb}: give the idempotency keys of the dead letters to {verb}, or --all for \
             every one of them ({dead} now; nothing was changed)"
        ),
    ))
}

/// The keys given, each once; an empty one is refused (a variable that expanded to
/// nothing, say).
fn distinct(keys: &[String]) -> Result<Vec<&str>, Failure> {
    if keys.iter().any(String::is_empty) {
        return Err(Failure::new(
            USAGE,
            "an idempotency key is empty (nothing was changed); to act on every dead letter, pass --all",
        ));
    }
    let mut keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    keys.sort_unstable();
    keys.dedup();
    Ok(keys)
}

/// Runs `act` on `keys` in one transaction, kept only if it acted on every key: a key that
/// is not a dead letter is named, and nothing changes.
async fn all_or_nothing(
    conn: &mut AsyncPgConnection,
    done: &str,
    keys: &[&str],
    act: impl AsyncFnOnce(&mut AsyncPgConnection) -> diesel_outbox::Result<Vec<String>>,
) -> Result<Vec<String>, Failure> {
    use diesel_async::{AnsiTransactionManager, TransactionManager};
    let db = |e: diesel::result::Error| Failure::from(diesel_outbox::Error::from(e));
    AnsiTransactionManager::begin_transaction(conn)
        .await
        .map_err(db)?;
    let acted = act(conn).await;
    let missing: Vec<&str> = match &acted {
        Ok(acted) => keys
            .iter()
            .copied()
            .filter(|k| acted.binary_search_by(|a| a.as_str().cmp(k)).is_err())
            .collect(),
        Err(_) => Vec::new(),
    };
    if acted.is_err() || !missing.is_empty() {
        AnsiTransactionManager::rollback_transaction(conn)
            .await
            .map_err(db)?;
        let acted = acted?;
        return Err(Failure::new(
            1,
            format!(
                "no dead letter has the key{} {} (nothing was {done}; {} of the {} keys are dead letters)",
                if missing.len() == 1 { "" } else { "s" },
                missing.join(", "),
                acted.len(),
                keys.len(),
            ),
        ));
    }
    AnsiTransactionManager::commit_transaction(conn)
        .await
        .map_err(db)?;
    Ok(acted?)
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
