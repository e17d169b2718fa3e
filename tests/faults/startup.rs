//! Start-up that meets PostgreSQL restarting or down: the relay (the binary) and the
//! consumer runner wait for the database for their connect timeout, then come up; past it
//! they fail with the cause (the relay with exit code 3, naming the host).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use diesel_async::AsyncConnection;
use diesel_outbox::consumer::{Consumer, handler_fn, rabbitmq};
use diesel_outbox::{Error, Message, Outbox};
use tokio::sync::mpsc;

use crate::common::broker::{SharedQueue, TestBroker, amqp_url, message_id, next};
use crate::common::{self, TestSchema, eventually};
use crate::suite::pg_ctlcluster;

const BIN: &str = env!("CARGO_BIN_EXE_diesel-outbox");

/// Long enough for a restart on a loaded machine, short of a hung test.
const DEADLINE: Duration = Duration::from_secs(90);

pub(crate) async fn run() {
    let _up = StartOnDrop;
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    let outbox = Outbox::builder()
        .table(&table)
        .engine(common::engine())
        .build()
        .unwrap();
    outbox.migrate(&mut schema.connect().await).await.unwrap();
    let broker = TestBroker::new("#").await;

    // A relay whose start meets a restart 20 ms, 100 ms or 300 ms in (it exited 1 with
    // "terminating connection due to administrator command"): it comes up and relays.
    let mut deliveries = broker.consumer().await;
    for (round, after) in [20, 100, 300].into_iter().enumerate() {
        let mut relay = spawn_relay(&table, &broker.exchange, "60s");
        tokio::time::sleep(Duration::from_millis(after)).await;
        pg_ctlcluster("restart");
        let key = enqueue(&outbox, &format!("restart-{round}")).await;
        let deadline = Instant::now() + DEADLINE;
        loop {
            assert!(
                relay.child.try_wait().unwrap().is_none(),
                "round {round}: the relay exited: {}",
                stderr_of(&mut relay)
            );
            assert!(
                Instant::now() < deadline,
                "round {round}: {key} not delivered"
            );
            if let Some(d) = next(&mut deliveries, Duration::from_millis(200)).await
                && message_id(&d) == key
            {
                break;
            }
        }
        assert_eq!(terminate(&mut relay).await, Some(0), "round {round}");
    }

    // Both started while the database is down: they wait, and work once it is up.
    drop(deliveries);
    let shared = SharedQueue::new().await;
    pg_ctlcluster("stop");
    let mut relay = spawn_relay(&table, &shared.exchange, "60s");
    let (seen, mut keys) = mpsc::unbounded_channel();
    let consumer = Consumer::builder(
        outbox.clone(),
        common::pool(2).await,
        common::unique("waits"),
    )
    .source(rabbitmq::Source::queue(amqp_url(), &shared.queue))
    .handler(handler_fn(move |delivery, _conn| {
        let seen = seen.clone();
        Box::pin(async move {
            let _ = seen.send(delivery.key.clone());
            Ok(())
        })
    }))
    .connect_timeout(Duration::from_secs(60))
    .build()
    .unwrap();
    let (stop, consuming) = common::spawn_consumer(consumer);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        relay.child.try_wait().unwrap().is_none(),
        "the relay gave up at once: {}",
        stderr_of(&mut relay)
    );
    assert!(!consuming.is_finished(), "the consumer gave up at once");
    pg_ctlcluster("start");
    let key = enqueue(&outbox, "after-start").await;
    let applied = tokio::time::timeout(DEADLINE, async {
        while let Some(k) = keys.recv().await {
            if k == key {
                return true;
            }
        }
        false
    })
    .await;
    if applied != Ok(true) {
        let ended = if consuming.is_finished() {
            format!("{:?}", consuming.await)
        } else {
            "still running".to_owned()
        };
        panic!("{key} not relayed and consumed ({applied:?}); the consumer: {ended}");
    }
    common::stop_relay(stop, consuming).await;
    assert_eq!(terminate(&mut relay).await, Some(0));

    // Past the connect timeout, both fail with the cause; the relay exits 3.
    pg_ctlcluster("stop");
    let relay = spawn_relay(&table, &shared.exchange, "2s");
    let consumer = Consumer::builder(
        outbox.clone(),
        common::pool(1).await,
        common::unique("gives_up"),
    )
    .source(rabbitmq::Source::queue(amqp_url(), &shared.queue))
    .handler(handler_fn(|_, _| Box::pin(async { Ok(()) })))
    .connect_timeout(Duration::from_secs(2))
    .build()
    .unwrap();
    let started = Instant::now();
    let err = common::start_error(consumer).await;
    assert!(matches!(err, Error::Pool(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("the database could not be reached in"),
        "{err}"
    );
    assert!(started.elapsed() >= Duration::from_secs(2), "{err}");
    let (code, stderr) = exit_of(relay).await;
    pg_ctlcluster("start");
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("cannot start the relay (the database at 127.0.0.1:5432): the database could not be reached in"),
        "{stderr}"
    );
    assert!(
        stderr.contains("trying again"),
        "each try is logged: {stderr}"
    );
}

/// Starts PostgreSQL again however the test ends, so the tests after it find it up.
struct StartOnDrop;

impl Drop for StartOnDrop {
    fn drop(&mut self) {
        if std::net::TcpStream::connect("127.0.0.1:5432").is_err() {
            pg_ctlcluster("start");
        }
    }
}

/// A relay process; its stderr goes to a file of its own (a pipe nobody reads would fill
/// and stop it), which [`stderr_of`] reads.
fn spawn_relay(table: &str, exchange: &str, connect_timeout: &str) -> Relay {
    let log = std::env::temp_dir().join(format!("startup-relay-{}.log", common::unique("r")));
    let file = std::fs::File::create(&log).expect("the relay's log file");
    let child = Command::new(BIN)
        .args(["--table", table, "relay", "--exchange", exchange])
        .args([
            "--poll-interval",
            "100ms",
            "--connect-timeout",
            connect_timeout,
        ])
        .env("DATABASE_URL", common::database_url())
        .env("AMQP_URL", amqp_url())
        .env("RUST_LOG", "diesel_outbox=info")
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .expect("start the relay");
    Relay { child, log }
}

/// A relay process and the file its stderr goes to.
struct Relay {
    child: Child,
    log: std::path::PathBuf,
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Enqueues a message once the database takes connections again; returns its key.
async fn enqueue(outbox: &Outbox, key: &str) -> String {
    let key = format!("{key}-{}", common::unique("k"));
    eventually(DEADLINE, "the database after the restart", || async {
        let mut conn = diesel_outbox::establish(&common::database_url())
            .await
            .ok()?;
        let msg = Message::new("order.created", "{}").key(&key);
        conn.transaction(async |c| outbox.enqueue(c, msg).await)
            .await
            .ok()
    })
    .await;
    key
}

/// SIGTERM, then the exit code (with a deadline).
async fn terminate(relay: &mut Relay) -> Option<i32> {
    let _ = Command::new("kill")
        .args(["-TERM", &relay.child.id().to_string()])
        .status();
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(status) = relay.child.try_wait().unwrap() {
            return status.code();
        }
        assert!(Instant::now() < deadline, "the relay did not stop");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (with a deadline) for the relay to exit by itself: its code and stderr.
async fn exit_of(mut relay: Relay) -> (Option<i32>, String) {
    let deadline = Instant::now() + DEADLINE;
    while relay.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the relay did not give up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let code = relay.child.try_wait().unwrap().and_then(|s| s.code());
    (code, stderr_of(&mut relay))
}

/// What the relay wrote to its stderr so far (after killing it, if it still runs).
fn stderr_of(relay: &mut Relay) -> String {
    let _ = relay.child.kill();
    let _ = relay.child.wait();
    std::fs::read_to_string(&relay.log).unwrap_or_default()
}
