//! The `diesel-outbox` binary, run as a user would, against the real services.
#![cfg(feature = "cli")]

mod common;

use common::Alone;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::broker::{TestBroker, amqp_url, message_id, next, rabbitmqctl};
use common::{TestSchema, database_url, eventually};
use diesel_async::SimpleAsyncConnection;
use diesel_outbox::{Message, Outbox};

const BIN: &str = env!("CARGO_BIN_EXE_diesel-outbox");

fn cli(table: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(["--table", table])
        .args(args)
        .env("DATABASE_URL", database_url())
        .env_remove("AMQP_URL")
        .output()
        .expect("run diesel-outbox")
}

/// Sends SIGTERM to a relay process and waits (with a deadline) for it to exit.
async fn terminate(relay: &mut std::process::Child) -> std::process::ExitStatus {
    let term = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    eventually(Duration::from_secs(30), "the relay to exit", || {
        let status = relay.try_wait().unwrap();
        async move { status }
    })
    .await
}

/// Reads a child's stderr as it is written (so the pipe never fills and blocks it);
/// the returned thread gives the whole log once the child has exited.
fn log_of(child: &mut std::process::Child) -> std::thread::JoinHandle<String> {
    let mut stderr = child.stderr.take().expect("stderr piped");
    std::thread::spawn(move || {
        let mut log = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
        log
    })
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_str(&stdout(out)).expect("--json prints JSON")
}

/// `migrate --engine` moves the table and says which engine it is on; without the flag
/// the engine stays; a name that is no engine is a usage error that changes nothing.
#[tokio::test]
async fn migrate_moves_the_engine_only_when_asked() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    let engine = |out: &Output| json(out)["engine"].as_str().unwrap().to_owned();
    assert_eq!(engine(&cli(&table, &["migrate", "--json"])), "per-row");
    assert_eq!(
        engine(&cli(&table, &["migrate", "--engine", "log", "--json"])),
        "log"
    );
    assert_eq!(engine(&cli(&table, &["migrate", "--json"])), "log");
    let bad = cli(&table, &["migrate", "--engine", "rows"]);
    assert_eq!(bad.status.code(), Some(2), "a usage error");
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("per-row, log"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert_eq!(engine(&cli(&table, &["migrate", "--json"])), "log");
    assert_eq!(
        stdout(&cli(&table, &["migrate", "--engine", "per-row"])).trim(),
        format!("{table} is migrated, on the per-row engine")
    );
}

/// A ledger left behind by a dropped table: `migrate` says what it found and what to do,
/// and creates nothing.
#[tokio::test]
async fn migrate_names_a_ledger_whose_table_is_gone() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    assert!(cli(&table, &["migrate"]).status.success());
    let mut conn = schema.connect().await;
    conn.batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
    let out = cli(&table, &["migrate"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the migration ledger {table}_migrations records schema version 5, but {table} does not exist"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("run `migrate`"), "{stderr}");
    let out = cli(&table, &["stats"]);
    assert_eq!(out.status.code(), Some(4), "still not there");
}

#[tokio::test]
async fn migrate_then_stats_shows_zeros() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    assert!(stdout(&cli(&table, &["migrate"])).contains("migrated"));
    let stats = json(&cli(&table, &["stats", "--json"]));
    for field in ["pending", "in_flight", "sent", "dead"] {
        assert_eq!(stats[field], 0, "{field} in {stats}");
    }
    assert!(stats["lag_seconds"].is_null());
    assert!(stats["blocked_for_seconds"].is_null(), "{stats}");
    let human = stdout(&cli(&table, &["stats"]));
    assert!(
        human.contains("pending") && human.contains(&table),
        "{human}"
    );
}

/// A live relay that cannot reach its broker: `stats` shows for how long, as the column
/// "blocked for" and as `blocked_for_seconds`; a relay whose record has expired counts
/// for nothing.
#[tokio::test]
async fn stats_shows_how_long_a_relay_has_been_blocked() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    assert!(stdout(&cli(&table, &["migrate"])).contains("migrated"));
    let mut conn = schema.connect().await;
    // The record a relay keeps while its broker is out of reach, 90 s into the outage,
    // and one of a relay gone long ago.
    conn.batch_execute(&format!(
        "INSERT INTO {table}_relays (relay_id, idle, expires_at, blocked_since) VALUES \
         ('blocked', false, now() + interval '1 hour', now() - interval '90 seconds'), \
         ('gone', false, now() - interval '1 hour', now() - interval '1 day')"
    ))
    .await
    .unwrap();
    let stats = json(&cli(&table, &["stats", "--json"]));
    let blocked = stats["blocked_for_seconds"]
        .as_f64()
        .unwrap_or_else(|| panic!("no blocked_for_seconds in {stats}"));
    assert!((90.0..3600.0).contains(&blocked), "{stats}");
    let human = stdout(&cli(&table, &["stats"]));
    let header = human.lines().find(|l| l.contains("pending")).unwrap();
    assert!(header.contains("blocked for"), "{human}");
    let cell = last_cell(&human, &table);
    let seconds: f64 = cell.strip_suffix('s').and_then(|c| c.parse().ok()).unwrap();
    assert!((90.0..3600.0).contains(&seconds), "{cell:?} in {human}");

    conn.batch_execute(&format!(
        "DELETE FROM {table}_relays WHERE relay_id = 'blocked'"
    ))
    .await
    .unwrap();
    let stats = json(&cli(&table, &["stats", "--json"]));
    assert!(stats["blocked_for_seconds"].is_null(), "{stats}");
    let human = stdout(&cli(&table, &["stats"]));
    assert_eq!(last_cell(&human, &table), "-", "{human}");
}

/// The last cell of the row of a printed table that names `key`.
fn last_cell<'a>(printed: &'a str, key: &str) -> &'a str {
    let row = printed.lines().find(|l| l.contains(key)).unwrap();
    row.split(['│', '┆'])
        .map(str::trim)
        .rfind(|cell| !cell.is_empty())
        .unwrap()
}

#[tokio::test]
async fn the_relay_process_publishes_and_exits_cleanly_on_sigterm() {
    let (_schema, table, outbox, mut conn) = migrated().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;

    // A short lease alone: the drain and confirm timeouts follow it.
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "relay", "--exchange", &broker.exchange])
        .args(["--poll-interval", "100ms", "--lease", "4s"])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = log_of(&mut relay);
    for i in 0..5 {
        outbox
            .enqueue_alone(
                &mut conn,
                Message::new("cli.test", "x").key(format!("k{i}")),
            )
            .await
            .unwrap();
    }
    let mut keys = Vec::new();
    while keys.len() < 5 {
        let d = next(&mut consumer, Duration::from_secs(30))
            .await
            .expect("the relay process publishes");
        keys.push(message_id(&d));
    }
    keys.sort();
    assert_eq!(keys, ["k0", "k1", "k2", "k3", "k4"]);

    let status = terminate(&mut relay).await;
    assert!(status.success(), "exit {status:?}");
    let log = log.join().unwrap();
    assert!(log.contains("relay stopped"), "{log}");
    assert!(!log.contains("guest:guest"), "no credentials in logs");
    let stats = json(&cli(&table, &["stats", "--json"]));
    assert_eq!(stats["sent"], 5);

    // A cursor lease out of range: a usage error naming it, before anything starts.
    let bad = Command::new(BIN)
        .args(["--table", &table, "relay", "--exchange", &broker.exchange])
        .args(["--cursor-lease", "50ms"])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cursor_lease 50ms must be between 100ms and 1 day"),
        "{err}"
    );
}

/// `--broker nats`: the same relay process, publishing to JetStream under a subject prefix.
#[tokio::test]
async fn the_relay_process_publishes_to_nats_jetstream_with_broker_nats() {
    use common::nats::{TestStream, header, nats_url};
    let (_schema, table, outbox, mut conn) = migrated().await;
    let stream = TestStream::new().await;
    let url = nats_url().replacen("nats://", "nats://relay:s3cret@", 1);
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "relay", "--broker", "nats"])
        .args([
            "--subject-prefix",
            &stream.prefix,
            "--poll-interval",
            "100ms",
        ])
        .env("DATABASE_URL", database_url())
        .env("NATS_URL", &url)
        .env_remove("AMQP_URL")
        .env("RUST_LOG", "trace")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = log_of(&mut relay);
    for i in 0..5 {
        outbox
            .enqueue_alone(
                &mut conn,
                Message::new("cli.test", "x").key(format!("k{i}")),
            )
            .await
            .unwrap();
    }
    common::eventually(
        Duration::from_secs(30),
        "5 messages in the stream",
        || async { (stream.stored().await == 5).then_some(()) },
    )
    .await;
    let mut keys: Vec<String> = stream
        .messages()
        .await
        .iter()
        .map(|m| {
            assert_eq!(m.subject.as_str(), format!("{}cli.test", stream.prefix));
            header(m, "Nats-Msg-Id").unwrap().to_owned()
        })
        .collect();
    keys.sort();
    assert_eq!(keys, ["k0", "k1", "k2", "k3", "k4"]);
    let status = terminate(&mut relay).await;
    assert!(status.success(), "exit {status:?}");
    let log = log.join().unwrap();
    assert!(log.contains("relay stopped"), "{log}");
    assert!(
        !log.contains("s3cret"),
        "no credentials in logs, even at trace"
    );

    // Without a URL: a usage error that says what is missing.
    let out = Command::new(BIN)
        .args(["--table", &table, "relay", "--broker", "nats"])
        .env("DATABASE_URL", database_url())
        .env_remove("NATS_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--nats-url"), "{err}");
}

#[tokio::test]
async fn dead_lists_a_dead_letter_and_redrive_brings_it_back() {
    let (_schema, table, outbox, mut conn) = migrated().await;
    outbox
        .enqueue_alone(
            &mut conn,
            Message::new("billing.charge", "x").key("charge-7"),
        )
        .await
        .unwrap();
    conn.batch_execute(&format!(
        "UPDATE {table} SET status = 'dead', dead_at = now(), attempts = 10, \
         last_error = 'card processor said no'"
    ))
    .await
    .unwrap();

    let human = stdout(&cli(&table, &["dead"]));
    for part in ["charge-7", "billing.charge", "10", "card processor said no"] {
        assert!(human.contains(part), "{part} missing from:\n{human}");
    }
    let listed = json(&cli(&table, &["dead", "--json", "--limit", "5"]));
    assert_eq!(listed["dead_letters"][0]["key"], "charge-7");
    assert_eq!(
        listed["dead_letters"][0]["last_error"],
        "card processor said no"
    );

    let redriven = stdout(&cli(&table, &["redrive", "charge-7"]));
    assert!(
        redriven.contains("redrove 1") && redriven.contains("charge-7"),
        "{redriven}"
    );
    let stats = json(&cli(&table, &["stats", "--json"]));
    assert_eq!(
        (stats["pending"].as_u64(), stats["dead"].as_u64()),
        (Some(1), Some(0))
    );
    let again = json(&cli(&table, &["redrive", "--all", "--json"]));
    assert_eq!(again["redriven"], serde_json::json!([]));
}

/// `redrive` and `discard` act on the keys given, all of which must be dead letters, or on
/// every dead letter with `--all`; no key (a variable that expanded to nothing), an empty
/// key, or a key that is no dead letter changes nothing and says why. `dead` filters by
/// topic and shows payloads when asked.
#[tokio::test]
async fn redrive_and_discard_need_keys_or_all_and_change_nothing_on_a_wrong_key() {
    let (_schema, table, outbox, mut conn) = migrated().await;
    for (key, topic, payload) in [
        ("a", "orders", b"{\"id\":1}".to_vec()),
        ("b", "no.such.topic", b"x".to_vec()),
        ("c", "orders", vec![0xff, 0x00, 0x9f]),
    ] {
        outbox
            .enqueue_alone(&mut conn, Message::new(topic, payload).key(key))
            .await
            .unwrap();
    }
    conn.batch_execute(&format!(
        "UPDATE {table} SET status = 'dead', dead_at = now(), attempts = 10, last_error = 'nope'"
    ))
    .await
    .unwrap();
    outbox
        .enqueue_alone(&mut conn, Message::new("orders", "y").key("d"))
        .await
        .unwrap();
    let dead = |table: &str| json(&cli(table, &["stats", "--json"]))["dead"].as_u64();

    for verb in ["redrive", "discard"] {
        let none = cli(&table, &[verb]);
        let err = String::from_utf8_lossy(&none.stderr);
        assert_eq!(none.status.code(), Some(2), "{verb}: {err}");
        assert!(
            err.contains("--all") && err.contains("(3 now; nothing was changed)"),
            "{verb}: {err}"
        );
        let empty = cli(&table, &[verb, ""]);
        let err = String::from_utf8_lossy(&empty.stderr);
        assert_eq!(empty.status.code(), Some(2), "{verb} \"\": {err}");
        assert!(err.contains("empty"), "{verb}: {err}");
        for wrong in [&["a", "nosuch"][..], &["a", "d"]] {
            let missing = wrong[1];
            let out = cli(&table, &[&[verb][..], wrong].concat());
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{verb} {wrong:?}: {err}");
            assert!(
                err.contains(&format!(
                    "no dead letter has the key {missing} (nothing was"
                )),
                "{verb} {wrong:?}: {err}"
            );
            assert_eq!(dead(&table), Some(3), "{verb} {wrong:?} changed something");
        }
    }

    let orders = json(&cli(&table, &["dead", "--topic", "orders", "--json"]));
    let keys: Vec<&str> = orders["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["a", "c"]);
    assert!(
        orders["dead_letters"][0].get("payload").is_none(),
        "{orders}"
    );
    let shown = json(&cli(
        &table,
        &["dead", "--topic", "orders", "--show-payload", "--json"],
    ));
    assert_eq!(shown["dead_letters"][0]["payload"], "{\"id\":1}");
    assert_eq!(shown["dead_letters"][0]["payload_encoding"], "utf-8");
    assert_eq!(shown["dead_letters"][1]["payload"], "/wCf");
    assert_eq!(shown["dead_letters"][1]["payload_encoding"], "base64");
    let human = stdout(&cli(&table, &["dead", "--show-payload"]));
    assert!(
        human.contains("base64:/wCf") && human.contains("no.such.topic"),
        "{human}"
    );

    let discarded = json(&cli(&table, &["discard", "b", "b", "--json"]));
    assert_eq!(
        discarded,
        serde_json::json!({"discarded": 1, "keys": ["b"]})
    );
    assert_eq!(dead(&table), Some(2));
    let redriven = json(&cli(&table, &["redrive", "c", "--json"]));
    assert_eq!(redriven["redriven"], serde_json::json!(["c"]));
    let all = json(&cli(&table, &["discard", "--all", "--json"]));
    assert_eq!(all, serde_json::json!({"discarded": 1}));
    let stats = json(&cli(&table, &["stats", "--json"]));
    assert_eq!(
        (stats["pending"].as_u64(), stats["dead"].as_u64()),
        (Some(2), Some(0)),
        "c redriven and d pending"
    );
    let conflict = cli(&table, &["redrive", "--all", "a"]);
    assert_eq!(conflict.status.code(), Some(2));
}

#[tokio::test]
async fn purge_and_sql_work_and_a_negative_age_is_a_usage_error() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    stdout(&cli(&table, &["migrate"]));
    let purged = json(&cli(
        &table,
        &["purge", "--json", "--sent-older-than", "1h"],
    ));
    assert_eq!(
        purged,
        serde_json::json!({"sent_rows": 0, "inbox_records": 0})
    );
    let bad = cli(&table, &["purge", "--sent-older-than", "-5d"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("negative"));

    let printed = stdout(&cli("shop.orders_outbox", &["sql"]));
    assert!(printed.contains("CREATE TABLE IF NOT EXISTS \"shop\".\"orders_outbox\""));
    let dir = std::env::temp_dir().join(common::unique("migrations"));
    let write = |table: &str| {
        stdout(&cli(table, &["sql", "--dir", dir.to_str().unwrap()]));
        let mut folders: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        folders.sort();
        folders
    };
    // The default table: the crate's own `migrations/` folders, byte for byte.
    let folders = write("outbox");
    let mut ours: Vec<_> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    ours.sort();
    assert_eq!(folders, ours);
    // Again: nothing changes, no second set.
    assert_eq!(write("outbox"), ours);
    std::fs::remove_dir_all(&dir).unwrap();
    let folders = write("orders_outbox");
    let rendered = Outbox::builder()
        .table("orders_outbox")
        .build()
        .unwrap()
        .diesel_migrations();
    assert_eq!(folders.len(), rendered.len(), "one folder per version");
    for (folder, m) in folders.iter().zip(&rendered) {
        assert_eq!(*folder, m.folder);
        let path = dir.join(folder);
        assert_eq!(std::fs::read_to_string(path.join("up.sql")).unwrap(), m.up);
        assert_eq!(
            std::fs::read_to_string(path.join("down.sql")).unwrap(),
            m.down
        );
    }
    // A folder of that name with other content is left alone, and named.
    std::fs::write(dir.join(&rendered[0].folder).join("up.sql"), "-- edited").unwrap();
    let refused = cli("orders_outbox", &["sql", "--dir", dir.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(1));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains(&rendered[0].folder) && err.contains("exists with other content"),
        "{err}"
    );
    let only = dir.join("only");
    stdout(&cli(
        "orders_outbox",
        &["sql", "--dir", only.to_str().unwrap(), "--version", "2"],
    ));
    let written: Vec<_> = std::fs::read_dir(&only).unwrap().collect();
    assert_eq!(written.len(), 1);
    let bad = cli("orders_outbox", &["sql", "--version", "99"]);
    assert_eq!(bad.status.code(), Some(2));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_urls_and_missing_tables_have_their_own_exit_codes_and_hide_passwords() {
    let out = Command::new(BIN)
        .args(["stats"])
        .env(
            "DATABASE_URL",
            "postgres://postgres:hunter2@127.0.0.1:1/test",
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("cannot connect to the database"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");

    let out = Command::new(BIN)
        .args(["relay", "--exchange", "x"])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", "amqp://guest:sekrit@127.0.0.1:1/%2f")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("sekrit"), "{stderr}");
    assert_ne!(out.status.code(), Some(0));

    let out = cli("never_migrated_here", &["stats"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("run `migrate` first"));

    let out = cli("Bad-Name", &["stats"]);
    assert_eq!(out.status.code(), Some(2));

    let out = Command::new(BIN).arg("no-such-command").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// Every URL and credential can come from a file (`--NAME-file`, or `NAME_FILE` as
/// container secrets are mounted): the file's content is used, less its trailing newline,
/// and never printed, not even when the connection it names fails.
#[tokio::test]
async fn urls_and_credentials_come_from_files_and_are_never_printed() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    let dir = std::env::temp_dir().join(common::unique("cli_secrets"));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("database-url");
    std::fs::write(&good, format!("{}\n", database_url())).unwrap();
    let with_file = |env: &[(&str, &std::path::Path)], args: &[&str]| {
        let mut command = Command::new(BIN);
        command
            .args(["--table", &table])
            .args(args)
            .env_remove("DATABASE_URL")
            .env_remove("AMQP_URL");
        for (name, path) in env {
            command.env(name, path);
        }
        command.output().unwrap()
    };
    let migrated = with_file(&[("DATABASE_URL_FILE", &good)], &["migrate"]);
    assert!(migrated.status.success(), "{migrated:?}");
    let flag = with_file(
        &[],
        &["--database-url-file", good.to_str().unwrap(), "stats"],
    );
    assert!(flag.status.success(), "{flag:?}");

    let bad = dir.join("bad-url");
    std::fs::write(&bad, "postgres://postgres:hunter2@127.0.0.1:1/test\n").unwrap();
    let amqp = dir.join("amqp-url");
    std::fs::write(&amqp, "amqp://guest:sekrit@127.0.0.1:1/%2f").unwrap();
    let out = with_file(&[("DATABASE_URL_FILE", &bad)], &["stats"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("127.0.0.1:1") && !stderr.contains("hunter2"),
        "{stderr}"
    );
    let out = with_file(
        &[("DATABASE_URL_FILE", &good), ("AMQP_URL_FILE", &amqp)],
        &["relay", "--exchange", "x"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(!stderr.contains("sekrit"), "{stderr}");
    let missing = with_file(&[("DATABASE_URL_FILE", &dir.join("none"))], &["stats"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read"));
    let _ = std::fs::remove_dir_all(dir);
}

/// At `RUST_LOG=trace` the relay process prints neither a payload (lapin logs returned
/// messages with theirs at warn, tokio-postgres logs bound parameters at debug) nor a
/// password (lapin logs the login frame at trace, amq-protocol the URL).
#[tokio::test]
async fn the_relay_at_trace_logs_no_payload_and_no_password() {
    relay_logs_no_secret(
        "the_relay_at_trace_logs_no_payload_and_no_password",
        "trace",
        "text",
    )
    .await;
}

/// `--log-format json` at `RUST_LOG=debug`: every line the relay writes is one JSON object
/// with tracing's fields, and none holds a payload or a password.
#[tokio::test]
async fn the_relay_logs_json_lines_without_payload_or_password() {
    let log = relay_logs_no_secret(
        "the_relay_logs_json_lines_without_payload_or_password",
        "debug",
        "json",
    )
    .await;
    let mut lines = 0;
    for line in log.lines().filter(|l| !l.is_empty()) {
        let object: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(
            object["level"].is_string() && object["fields"].is_object(),
            "{line}"
        );
        lines += 1;
    }
    assert!(lines > 10, "{lines} lines");
}

/// A relay process at `rust_log` with `--log-format format` dead-letters an unroutable
/// message; what it logged holds no payload and no password. Returns the log.
async fn relay_logs_no_secret(test: &str, rust_log: &str, format: &str) -> String {
    // It adds a RabbitMQ user with the local broker's own tool.
    if !common::services::local_tools_for(test, &[common::services::Service::RabbitMq]) {
        return String::new();
    }
    let (_schema, table, outbox, mut conn) = migrated().await;
    let broker = TestBroker::new("bound.only").await;
    let user = common::unique("outbox_user");
    let password = common::unique("pw-secret");
    rabbitmqctl(&["add_user", &user, &password]);
    rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    let marker = common::unique("payload-marker");
    outbox
        .enqueue_alone(
            &mut conn,
            Message::new("nowhere", marker.clone()).key("unroutable"),
        )
        .await
        .unwrap();
    let amqp = format!("amqp://{user}:{password}@127.0.0.1:5672/%2f");
    let db_password = common::unique("db-secret");
    // Trust authentication ignores the password; it must not be printed all the same.
    let database = database_url().replacen("postgres@", &format!("postgres:{db_password}@"), 1);
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "--log-format", format, "relay"])
        .args(["--exchange", &broker.exchange])
        .args(["--max-attempts", "1", "--poll-interval", "100ms"])
        .env("DATABASE_URL", &database)
        .env("AMQP_URL", &amqp)
        .env("RUST_LOG", rust_log)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let reader = log_of(&mut relay);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while outbox.dead_letters(&mut conn, 10).await.unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the unroutable message never died"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = terminate(&mut relay).await;
    let log = reader.join().unwrap();
    rabbitmqctl(&["delete_user", &user]);
    assert!(status.success(), "exit {status:?}");
    assert!(
        log.contains("DEBUG"),
        "the filter passed RUST_LOG on: {log}"
    );
    assert!(log.contains("unroutable"), "the failure is logged by key");
    for (what, secret) in [
        ("the payload", &marker),
        ("the AMQP password", &password),
        ("the database password", &db_password),
    ] {
        // As text, and as the byte list `Debug` prints for a `Vec<u8>`.
        let bytes = secret
            .bytes()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        assert!(
            !log.contains(secret.as_str()),
            "{what} reached the log as text"
        );
        assert!(!log.contains(&bytes), "{what} reached the log as bytes");
    }
    log
}

/// The sum of a Prometheus metric's samples in `text`, whatever their labels.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits until `path` answers `code` with a body holding `text`.
async fn wait_probe(addr: std::net::SocketAddr, path: &str, code: u16, text: &str) {
    let what = format!("{path} to answer {code} with {text:?}");
    eventually(Duration::from_secs(30), &what, || async {
        common::http::get(addr, path).filter(|(c, body)| *c == code && body.contains(text))
    })
    .await;
}

/// A schema of the test's own with a migrated outbox table: the schema (dropped with it),
/// the table's name, its outbox and a connection.
async fn migrated() -> (TestSchema, String, Outbox, diesel_async::AsyncPgConnection) {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    let outbox = Outbox::builder().table(&table).build().unwrap();
    let mut conn = schema.connect().await;
    outbox.migrate(&mut conn).await.unwrap();
    (schema, table, outbox, conn)
}

/// The relay process's probes on its one listener: `/livez` and `/readyz` answer 200 while
/// it works; `/readyz` turns 503 with "broker unavailable" while the broker is out of reach
/// (through a fault proxy) and with "database unreachable" while the database is, and 200
/// again after each, while `/livez` stays 200. The metrics are served beside them.
#[tokio::test]
async fn the_relay_probes_follow_the_broker_and_the_database() {
    use common::proxy::FaultProxy;
    use std::net::ToSocketAddrs;
    let (_schema, table, outbox, mut conn) = migrated().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let upstream = |authority: String| authority.to_socket_addrs().unwrap().next().unwrap();
    let mq = FaultProxy::start(upstream(common::broker::amqp_authority())).await;
    let database = database_url();
    let rest = database.split_once("://").unwrap().1;
    let authority = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let authority = authority.split('/').next().unwrap().to_owned();
    let pg = FaultProxy::start(upstream(authority.clone())).await;
    let [port] = common::cluster::free_ports();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "relay", "--exchange", &broker.exchange])
        .args([
            "--poll-interval",
            "100ms",
            "--backoff-min",
            "50ms",
            "--backoff-max",
            "200ms",
        ])
        .args(["--metrics-addr", &addr.to_string()])
        .env(
            "DATABASE_URL",
            database.replacen(&authority, &pg.addr.to_string(), 1),
        )
        .env("AMQP_URL", common::broker::amqp_url_via(mq.addr))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_probe(addr, "/readyz", 200, "\"ready\":true").await;
    wait_probe(addr, "/livez", 200, "\"live\":true").await;

    mq.set_down(true);
    outbox
        .enqueue_alone(&mut conn, Message::new("probe.test", "x").key("held"))
        .await
        .unwrap();
    wait_probe(addr, "/readyz", 503, "broker unavailable").await;
    assert_eq!(
        common::http::get(addr, "/livez").unwrap().0,
        200,
        "still live"
    );
    mq.set_down(false);
    wait_probe(addr, "/readyz", 200, "\"ready\":true").await;
    let delivery = next(&mut consumer, Duration::from_secs(30))
        .await
        .expect("published once the broker is back");
    assert_eq!(message_id(&delivery), "held");

    pg.set_down(true);
    wait_probe(addr, "/readyz", 503, "database unreachable").await;
    pg.set_down(false);
    wait_probe(addr, "/readyz", 200, "\"ready\":true").await;
    let metrics = common::http::get(addr, "/metrics").unwrap();
    assert!(
        metrics.1.contains("outbox_published_total"),
        "{}",
        metrics.1
    );
    let status = terminate(&mut relay).await;
    assert!(status.success(), "{status:?}");
}

/// A relay started while its broker is down: without `--start-without-broker` it exits 3
/// naming the broker; with it, it runs, `/readyz` says "broker unavailable", and what was
/// enqueued goes out once the broker is up.
// Two worker threads: the fault proxy turns connections away while the test waits for the
// relay that tries them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_starts_without_its_broker_when_told_to() {
    let (_schema, table, outbox, mut conn) = migrated().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let mq = common::proxy::FaultProxy::down_before(&common::broker::amqp_authority()).await;
    let relay = |extra: &[&str]| {
        let mut command = Command::new(BIN);
        command
            .args(["--table", &table, "relay", "--exchange", &broker.exchange])
            .args(["--backoff-min", "50ms", "--backoff-max", "200ms"])
            .args(extra)
            .env("DATABASE_URL", database_url())
            .env("AMQP_URL", common::broker::amqp_url_via(mq.addr));
        command
    };
    let refused = relay(&[]).output().unwrap();
    assert_eq!(refused.status.code(), Some(3), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("RabbitMQ"), "{stderr}");

    let [port] = common::cluster::free_ports();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut running = relay(&[
        "--start-without-broker",
        "--metrics-addr",
        &addr.to_string(),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    outbox
        .enqueue_alone(&mut conn, Message::new("probe.test", "x").key("held"))
        .await
        .unwrap();
    wait_probe(addr, "/readyz", 503, "broker unavailable").await;
    mq.set_down(false);
    let delivery = next(&mut consumer, Duration::from_secs(30))
        .await
        .expect("published once the broker is up");
    assert_eq!(message_id(&delivery), "held");
    wait_probe(addr, "/readyz", 200, "\"ready\":true").await;
    let status = terminate(&mut running).await;
    assert!(status.success(), "{status:?}");
}

/// Runs a relay process with `--metrics-addr` (and `extra` arguments), has it publish 7
/// messages, and returns its metrics once they count all 7 (published, their durations and
/// their lags), and the table's name.
async fn metrics_after_seven_published(extra: &[&str]) -> (String, String) {
    let (_schema, table, outbox, mut conn) = migrated().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "relay", "--exchange", &broker.exchange])
        .args([
            "--poll-interval",
            "100ms",
            "--metrics-addr",
            &addr.to_string(),
        ])
        .args(extra)
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    for i in 0..7 {
        outbox
            .enqueue_alone(
                &mut conn,
                Message::new("cli.metrics", "x").key(format!("m{i}")),
            )
            .await
            .unwrap();
    }
    for _ in 0..7 {
        next(&mut consumer, Duration::from_secs(30))
            .await
            .expect("the relay process publishes");
    }
    let scraped = eventually(
        Duration::from_secs(30),
        "7 published, timed and lagged",
        || {
            let body = common::http::get(addr, "/metrics").map(|(_, body)| body);
            async move {
                body.filter(|b| {
                    metric_sum(b, "outbox_published_total") == 7.0
                        && metric_sum(b, "outbox_publish_duration_seconds_count") == 7.0
                        && metric_sum(b, "outbox_delivery_lag_seconds_count") == 7.0
                })
            }
        },
    )
    .await;
    let status = terminate(&mut relay).await;
    assert!(status.success(), "exit {status:?}");
    (scraped, table)
}

/// Checks the Prometheus text `scraped`: every `outbox_` sample belongs to a family with a
/// `# TYPE` and a `# HELP` line, and the publish duration and the delivery lag are
/// histograms whose buckets end at `bounds` (and `+Inf`).
fn assert_described_histograms(scraped: &str, bounds: &[&str]) {
    let declared = |what: &str| -> Vec<(String, String)> {
        scraped
            .lines()
            .filter_map(|l| l.strip_prefix(what))
            .filter_map(|l| l.split_once(' '))
            .map(|(name, rest)| (name.to_owned(), rest.to_owned()))
            .collect()
    };
    let types = declared("# TYPE ");
    let helps = declared("# HELP ");
    let families: Vec<&str> = types
        .iter()
        .filter(|(name, _)| name.starts_with("outbox_"))
        .map(|(name, _)| name.as_str())
        .collect();
    for family in [
        "outbox_claimed_total",
        "outbox_published_total",
        "outbox_publish_duration_seconds",
        "outbox_delivery_lag_seconds",
    ] {
        assert!(families.contains(&family), "{family}: {scraped}");
    }
    for family in &families {
        let help = helps.iter().find(|(name, _)| name == family);
        assert!(
            help.is_some_and(|(_, text)| !text.trim().is_empty()),
            "# HELP {family}: {scraped}"
        );
    }
    for sample in scraped
        .lines()
        .filter(|l| l.starts_with("outbox_"))
        .filter_map(|l| l.split(['{', ' ']).next())
    {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| sample.strip_suffix(suffix))
            .filter(|base| families.contains(base))
            .unwrap_or(sample);
        assert!(
            families.contains(&family),
            "{sample} has no # TYPE: {scraped}"
        );
    }
    for histogram in [
        "outbox_publish_duration_seconds",
        "outbox_delivery_lag_seconds",
    ] {
        assert!(
            scraped.contains(&format!("# TYPE {histogram} histogram\n")),
            "{scraped}"
        );
        let les: Vec<&str> = scraped
            .lines()
            .filter(|l| l.starts_with(&format!("{histogram}_bucket{{")))
            .filter(|l| l.contains("topic=\"cli.metrics\""))
            .filter_map(|l| l.split(",le=\"").nth(1)?.split('"').next())
            .collect();
        let mut expected = bounds.to_vec();
        expected.push("+Inf");
        assert_eq!(les, expected, "{histogram}: {scraped}");
        assert!(
            scraped
                .lines()
                .any(|l| l.starts_with(&format!("{histogram}_bucket{{"))
                    && l.contains(",le=\"+Inf\"")
                    && l.ends_with(" 7")),
            "all 7 in the +Inf bucket: {scraped}"
        );
        assert!(
            !scraped.contains(&format!("{histogram}{{")),
            "no summary: {scraped}"
        );
    }
}

/// The relay's metrics endpoint: every `outbox_` family with its `# HELP` and `# TYPE`,
/// the durations and lags as histograms with the default buckets (1 ms to 60 s).
#[tokio::test]
async fn the_relay_serves_its_metrics_to_prometheus() {
    let (scraped, table) = metrics_after_seven_published(&[]).await;
    assert!(
        scraped.contains("outbox_publish_duration_seconds"),
        "{scraped}"
    );
    assert!(scraped.contains(&format!("table=\"{table}\"")), "{scraped}");
    assert_described_histograms(
        &scraped,
        &[
            "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5",
            "5", "10", "30", "60",
        ],
    );
    assert!(
        scraped.contains("# TYPE outbox_published_total counter\n"),
        "{scraped}"
    );
}

/// `--metrics-buckets` gives the histograms their bucket bounds.
#[tokio::test]
async fn the_relay_exports_the_buckets_asked_for() {
    let (scraped, _) =
        metrics_after_seven_published(&["--metrics-buckets", "0.005,0.05,0.5,5"]).await;
    assert_described_histograms(&scraped, &["0.005", "0.05", "0.5", "5"]);
}

/// Bucket bounds that are not positive, finite and strictly increasing, or given without
/// `--metrics-addr`, are a usage error (exit 2) that says what is wrong.
#[test]
fn bad_metrics_buckets_are_a_usage_error() {
    for (buckets, says) in [
        (
            "0.1,0.05",
            "0.05 follows 0.1: the bounds must be strictly increasing",
        ),
        ("0,1", "the bucket bound 0 is not positive"),
        ("-0.5,1", "the bucket bound -0.5 is not positive"),
        ("0.1,inf", "the bucket bound inf is not finite"),
        ("0.1,fast", "\"fast\" is not a number of seconds"),
        ("0.1,,1", "a bucket bound is empty"),
    ] {
        let args = [
            "relay",
            "--metrics-addr",
            "127.0.0.1:9",
            "--metrics-buckets",
            buckets,
        ];
        let out = cli("outbox", &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        let line = common::error_line(&args, &stderr);
        assert!(
            line.contains("--metrics-buckets") && line.contains(says),
            "{args:?}: {line}"
        );
    }
    let out = cli("outbox", &["relay", "--metrics-buckets", "0.1,1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--metrics-addr"), "{stderr}");
}

#[tokio::test]
async fn stats_watch_prints_one_reading_a_second_for_count_readings() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    assert!(stdout(&cli(&table, &["migrate"])).contains("migrated"));
    let started = std::time::Instant::now();
    let out = stdout(&cli(
        &table,
        &["stats", "--watch", "--count", "3", "--json"],
    ));
    let readings: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON line per reading"))
        .collect();
    assert_eq!(readings.len(), 3, "{out}");
    assert!(readings.iter().all(|r| r["pending"] == 0));
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "a second between readings: {:?}",
        started.elapsed()
    );
    let bad = cli(&table, &["stats", "--count", "3"]);
    assert_eq!(bad.status.code(), Some(2), "--count needs --watch");
    let zero = cli(&table, &["stats", "--watch", "--count", "0"]);
    assert_eq!(zero.status.code(), Some(2), "--count 0 is a usage error");
}

/// `declare` creates what the relay and its consumers need, and running it again changes
/// nothing: on RabbitMQ the exchange, a queue and its dead letters, on NATS a stream and a
/// durable consumer. A relay on an exchange that does not exist stops at once with exit
/// code 5, naming it.
#[tokio::test]
async fn declare_creates_the_topology_and_a_relay_on_a_missing_exchange_exits_five() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    assert!(stdout(&cli(&table, &["migrate"])).contains("migrated"));
    let exchange = common::unique("x");
    let queue = common::unique("q");
    let run = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .env("AMQP_URL", amqp_url())
            .env("NATS_URL", common::nats_url())
            .output()
            .unwrap()
    };
    let rabbit = [
        "declare",
        "--exchange",
        &exchange,
        "--queue",
        &queue,
        "--json",
    ];
    for _ in 0..2 {
        let out = json(&run(&rabbit));
        assert_eq!(out["declared"][0], format!("exchange {exchange}"), "{out}");
    }
    let prefix = format!("{}.", common::unique("cli"));
    let stream = prefix.trim_end_matches('.').to_uppercase();
    let nats = [
        "declare",
        "--broker",
        "nats",
        "--stream",
        &stream,
        "--subject-prefix",
        &prefix,
        "--durable",
        "invoicing",
    ];
    for _ in 0..2 {
        let out = run(&nats);
        assert!(stdout(&out).contains(&format!("stream {stream}")));
    }

    let missing = common::unique("missing");
    let out = Command::new(BIN)
        .args(["--table", &table, "relay", "--exchange", &missing])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stderr}");
    assert!(
        stderr.contains(&format!("exchange `{missing}` does not exist")),
        "{stderr}"
    );

    let dead = format!("{queue}.dead");
    common::broker::delete(&[&queue, &dead], &[&exchange, &dead]).await;
    let js = async_nats::jetstream::new(common::nats::connect().await);
    let _ = js.delete_stream(&stream).await;
}

/// `declare --broker kafka` creates the topics with their partitions (again: nothing
/// changes), and `relay --broker kafka` ships the table's messages to them under its topic
/// prefix, then stops on SIGTERM with exit code 0.
#[cfg(feature = "kafka")]
#[tokio::test]
async fn declare_and_relay_on_kafka() {
    if !common::services::needs("declare_and_relay_on_kafka", common::kafka::missing()) {
        return;
    }
    let brokers = common::kafka::brokers();
    let (_schema, table, outbox, mut conn) = migrated().await;
    let prefix = format!("{}.", common::unique("cli"));
    let topic = format!("{prefix}order.created");
    for done in ["created", "found"] {
        let out = Command::new(BIN)
            .args(["declare", "--broker", "kafka", "--topic", &topic])
            .args(["--partitions", "2", "--replication", "1", "--json"])
            .env("KAFKA_BROKERS", &brokers)
            .output()
            .unwrap();
        let out = json(&out);
        assert_eq!(
            out["declared"][0],
            format!("topic {topic} ({done} with 2 partitions)"),
            "{out}"
        );
    }
    for i in 0..5 {
        outbox
            .enqueue_alone(
                &mut conn,
                Message::new("order.created", format!("order {i}")).key(format!("k{i}")),
            )
            .await
            .unwrap();
    }
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "relay", "--broker", "kafka"])
        .args(["--topic-prefix", &prefix, "--poll-interval", "100ms"])
        .env("DATABASE_URL", database_url())
        .env("KAFKA_BROKERS", &brokers)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let read = common::kafka::read(&brokers, std::slice::from_ref(&topic), 2, 5).await;
    let mut keys: Vec<String> = read
        .iter()
        .map(|m| m.headers["x-outbox-message-id"].clone())
        .collect();
    keys.sort();
    assert_eq!(keys, ["k0", "k1", "k2", "k3", "k4"]);
    eventually(common::DEADLINE, "every row sent", || {
        let outbox = outbox.clone();
        let url = database_url();
        async move {
            let mut conn =
                <diesel_async::AsyncPgConnection as diesel_async::AsyncConnection>::establish(&url)
                    .await
                    .ok()?;
            let stats = outbox.stats(&mut conn).await.ok()?;
            (stats.sent == 5).then_some(())
        }
    })
    .await;
    let status = terminate(&mut relay).await;
    assert!(status.success(), "exit {status:?}");
}

/// `declare --broker kafka` on a topic that exists with other partitions than asked for
/// leaves it as it is and says so, in words, in JSON and as a warning; never that it has
/// the partitions asked for.
#[cfg(feature = "kafka")]
#[tokio::test]
async fn declare_on_kafka_says_what_it_found() {
    if !common::services::needs(
        "declare_on_kafka_says_what_it_found",
        common::kafka::missing(),
    ) {
        return;
    }
    let brokers = common::kafka::brokers();
    let topic = format!("{}.order.created", common::unique("cli"));
    let declare = |partitions: &str, json: bool| {
        let mut command = Command::new(BIN);
        command
            .args(["declare", "--broker", "kafka", "--topic", &topic])
            .args(["--partitions", partitions, "--replication", "1"])
            .env("KAFKA_BROKERS", &brokers)
            .env_remove("RUST_LOG");
        if json {
            command.arg("--json");
        }
        command.output().unwrap()
    };
    let created = stdout(&declare("3", false));
    assert!(
        created.contains(&format!("topic {topic} (created with 3 partitions)")),
        "{created}"
    );
    let found = declare("6", false);
    let said = stdout(&found);
    assert!(
        said.contains(&format!(
            "topic {topic} (found with 3 partitions, not the 6 asked for)"
        )),
        "{said}"
    );
    assert!(!said.contains("(6 partitions)"), "{said}");
    let warned = String::from_utf8_lossy(&found.stderr);
    assert!(
        warned.contains("WARN") && warned.contains("other partitions than asked for"),
        "{warned}"
    );
    let out = json(&declare("6", true));
    assert_eq!(
        out["topics"][0],
        serde_json::json!({
            "name": topic,
            "partitions": 3,
            "partitions_asked": 6,
            "created": false,
        }),
        "{out}"
    );
}

/// Reads a child's stderr line by line as it is written; the lines so far are in the
/// returned list.
fn lines_of(child: &mut std::process::Child) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    let stderr = child.stderr.take().expect("stderr piped");
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let written = lines.clone();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)) {
            let Ok(line) = line else { break };
            written.lock().unwrap().push(line);
        }
    });
    lines
}

/// The relay's start is logged with each option as a field of its own: with
/// `--log-format json`, keys of their own beside the message, not one `Options { … }`
/// string.
#[tokio::test]
async fn the_relay_logs_its_options_as_fields_of_their_own() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    assert!(stdout(&cli(&table, &["migrate"])).contains("migrated"));
    let broker = TestBroker::new("#").await;
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "--log-format", "json", "relay"])
        .args(["--exchange", &broker.exchange])
        .args([
            "--batch-size",
            "7",
            "--poll-interval",
            "150ms",
            "--lease",
            "4s",
        ])
        .args(["--retention", "off"])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut relay);
    let started = eventually(Duration::from_secs(30), "the relay's start logged", || {
        let found = lines
            .lock()
            .unwrap()
            .iter()
            .find(|l| l.contains("relay started"))
            .cloned();
        async move { found }
    })
    .await;
    let status = terminate(&mut relay).await;
    assert!(status.success(), "exit {status:?}");
    let line: serde_json::Value = serde_json::from_str(&started).expect("a JSON line");
    let fields = &line["fields"];
    assert_eq!(fields["message"], "relay started", "{line}");
    assert_eq!(fields["table"], table.as_str(), "{line}");
    assert_eq!(fields["batch_size"], 7, "{line}");
    assert_eq!(fields["poll_interval"], "150ms", "{line}");
    assert_eq!(fields["lease"], "4s", "{line}");
    assert_eq!(fields["drain_timeout"], "2s", "fitted to the lease: {line}");
    assert_eq!(fields["retention"], "off", "{line}");
    assert_eq!(fields["inbox_retention"], "2592000s", "{line}");
    for key in [
        "relay",
        "concurrency",
        "max_attempts",
        "backoff_min",
        "backoff_max",
        "listen",
        "max_batch_bytes",
    ] {
        assert!(fields.get(key).is_some(), "no {key} in {line}");
    }
    assert!(fields.get("options").is_none(), "{line}");
    assert!(!started.contains("Options {"), "{started}");
}

/// Another broker's address where the broker chosen (RabbitMQ unless `--broker` says
/// otherwise) expects its own: a usage error that says `--broker` picks the broker, before
/// any connection (the database here cannot be reached), never showing the address.
#[test]
fn another_brokers_address_hints_at_the_broker_flag() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut command = Command::new(BIN);
        command
            .args(args)
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/test")
            .env_remove("AMQP_URL")
            .env_remove("NATS_URL")
            .env_remove("KAFKA_BROKERS")
            .env_remove("OUTBOX_BROKER");
        for (name, value) in env {
            command.env(name, value);
        }
        let out = command.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let relay = ["relay", "--exchange", "events", "--connect-timeout", "30s"];
    let declare_rabbit = ["declare", "--exchange", "events"];
    for (args, env, hint) in [
        // A Kafka address as the RabbitMQ URL, from a flag or the environment.
        (
            [&relay[..], &["--amqp-url", "127.0.0.1:9092"]].concat(),
            &[][..],
            "--broker kafka",
        ),
        (
            relay.to_vec(),
            &[("AMQP_URL", "kafka://127.0.0.1:9092")][..],
            "--broker kafka",
        ),
        (
            [
                &declare_rabbit[..],
                &["--amqp-url", "kafka://k1:9092,k2:9092"],
            ]
            .concat(),
            &[],
            "--broker kafka",
        ),
        // Kafka's brokers given, and no RabbitMQ URL.
        (
            [&relay[..], &["--kafka-brokers", "127.0.0.1:9092"]].concat(),
            &[],
            "--broker kafka",
        ),
        // A NATS URL as the RabbitMQ URL, and NATS's given without one.
        (
            [&relay[..], &["--amqp-url", "nats://127.0.0.1:4222"]].concat(),
            &[],
            "--broker nats",
        ),
        (
            relay.to_vec(),
            &[("NATS_URL", "nats://127.0.0.1:4222")][..],
            "--broker nats",
        ),
        // A RabbitMQ URL where NATS or Kafka expects its own.
        (
            vec![
                "declare",
                "--broker",
                "nats",
                "--stream",
                "S",
                "--subject-prefix",
                "s.",
                "--nats-url",
                "amqp://guest:hunter2@127.0.0.1:5672/%2f",
            ],
            &[],
            "--broker rabbitmq",
        ),
        (
            vec!["relay", "--broker", "kafka", "--connect-timeout", "30s"],
            &[("KAFKA_BROKERS", "amqps://guest:hunter2@127.0.0.1:5671")][..],
            "--broker rabbitmq",
        ),
    ] {
        let started = std::time::Instant::now();
        let (code, err) = run(&args, env);
        assert_eq!(code, Some(2), "{args:?} {env:?}: {err}");
        assert!(err.contains(hint), "{args:?} {env:?}: {err}");
        for shown in ["hunter2", "9092", "4222", "5672"] {
            assert!(
                !err.contains(shown),
                "{args:?} {env:?} shows {shown}: {err}"
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{args:?} waited for the database"
        );
    }
}

/// A broker out of reach, at the relay's start and in `declare`: the error names the broker
/// and its cause once, never "publish failed", and exits 3.
#[tokio::test]
async fn a_broker_out_of_reach_is_named_with_its_cause_once() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    assert!(stdout(&cli(&table, &["migrate"])).contains("migrated"));
    let refused = "amqp://guest:guest@127.0.0.1:1/%2f";
    for command in [
        &["--table", &table, "relay", "--exchange", "events"][..],
        &["declare", "--exchange", "events"],
    ] {
        let out = Command::new(BIN)
            .args(command)
            .env("DATABASE_URL", database_url())
            .env("AMQP_URL", refused)
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{command:?}: {stderr}");
        let error = common::error_line(&command, &stderr);
        assert!(
            error.contains("RabbitMQ at 127.0.0.1:1"),
            "{command:?}: {error}"
        );
        assert_eq!(
            error.to_lowercase().matches("connection refused").count(),
            1,
            "{command:?}: {error}"
        );
        assert!(!error.contains("publish failed"), "{command:?}: {error}");
        assert!(!stderr.contains("guest:guest"), "{command:?}: {stderr}");
    }
}

/// `--kafka-property` with a key the crate owns, for `declare` and for `relay`: a usage
/// error (exit 2) naming the key and why, before anything connects to Kafka (nothing
/// listens at the brokers given), never showing the value; a pair without `=` likewise.
#[tokio::test]
async fn a_kafka_property_the_crate_owns_is_refused_as_a_usage_error() {
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    assert!(stdout(&cli(&table, &["migrate"])).contains("migrated"));
    let declare = ["declare", "--broker", "kafka", "--topic", "t"];
    let relay = ["--table", &table, "relay", "--broker", "kafka"];
    for (command, property, said) in [
        (
            &declare[..],
            "allow.auto.create.topics=hunter2",
            "the Kafka property `allow.auto.create.topics` is the crate's own: looking at a \
             topic must not create it",
        ),
        (
            &relay[..],
            "enable.idempotence=hunter2",
            "the Kafka property `enable.idempotence` is the crate's own: the producer is \
             idempotent",
        ),
        (
            &relay[..],
            "bootstrap.servers=hunter2:9092",
            "the Kafka property `bootstrap.servers` is the crate's own: the brokers are the \
             `brokers` argument (--kafka-brokers)",
        ),
        (
            &declare[..],
            "sasl.password:hunter2",
            "--kafka-property takes KEY=VALUE: the 2nd given is not (not shown)",
        ),
    ] {
        let started = std::time::Instant::now();
        let out = Command::new(BIN)
            .args(command)
            .args(["--kafka-property", "client.id=billing", "--kafka-property"])
            .arg(property)
            .env("DATABASE_URL", database_url())
            .env("KAFKA_BROKERS", "127.0.0.1:1")
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{property}: {stderr}");
        let error = common::error_line(&property, &stderr);
        assert!(error.contains(said), "{property}: {error}");
        assert!(!stderr.contains("hunter2"), "{property}: {stderr}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{property}: waited for Kafka"
        );
    }
}

/// `relay --help` and `declare --help` give each broker's flags under its own heading,
/// after the options every broker shares.
#[test]
fn the_help_groups_the_flags_by_broker() {
    for command in ["relay", "declare"] {
        let help = Command::new(BIN)
            .args([command, "--help"])
            .output()
            .unwrap();
        assert!(help.status.success(), "{help:?}");
        let help = String::from_utf8(help.stdout).unwrap();
        let heading = |name: &str| {
            help.find(&format!("\n{name}:\n"))
                .unwrap_or_else(|| panic!("no {name} heading in {command} --help:\n{help}"))
        };
        let flag = |name: &str| {
            help.find(&format!(" --{name} "))
                .unwrap_or_else(|| panic!("no --{name} in {command} --help:\n{help}"))
        };
        let (rabbitmq, kafka, nats) = (heading("RabbitMQ"), heading("Kafka"), heading("NATS"));
        assert!(flag("broker") < rabbitmq, "--broker is for every broker");
        assert!((rabbitmq..kafka).contains(&flag("amqp-url")));
        assert!((kafka..nats).contains(&flag("kafka-brokers")));
        assert!(nats < flag("nats-url"));
    }
}
