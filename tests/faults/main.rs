//! Fault injection: the crate's guarantees under crashes, pauses, cuts, outages and
//! failovers.
//!
//! Writers enqueue in transactions that also write a business row with a per-aggregate
//! sequence taken under a row lock; about 20% roll back (half of those to a savepoint).
//! Three relays run as separate processes (the `diesel-outbox relay` binary); a consumer
//! (the crate's runner) records every delivery and applies its effect with `dedupe` in its
//! own transaction. Then the faults stop, everything drains, and a checker reads ground truth
//! from the database and the delivery log: nothing lost, no phantom, order kept per
//! aggregate, one effect per message, no dead letter but the poison rows, no row left
//! leased (`harness.rs`).
//!
//! - The mixed run (`suite.rs`), once per broker (RabbitMQ, restarted with `rabbitmqctl`;
//!   NATS JetStream, nats-server restarted, its store on disk surviving; Kafka, a Tansu of
//!   the run's own, paused with SIGSTOP since a restart would empty its memory storage,
//!   every client connection through the fault proxy, the consumer's too): relays
//!   SIGKILLed, SIGSTOPped beyond their lease (stale relays must be fenced), their
//!   PostgreSQL backends (LISTEN included) terminated, their broker connections cut through
//!   a TCP fault proxy, the broker restarted (paused) and stopped (paused) for longer than
//!   `max_attempts × backoff max`,
//!   PostgreSQL restarted (a writer whose commit outcome is then unknown is resolved against
//!   the business rows), and poison rows written by SQL (headers serde cannot read, an
//!   `infinity` enqueue time, headers too large for the broker, a header or topic it
//!   refuses).
//! - PostgreSQL failover (`failover.rs`): a primary and a streaming replica of the test's
//!   own, synchronous or asynchronous; mid-run the replica is promoted and the old primary
//!   stopped (an asynchronous one a moment later, so that the new primary lacks its last
//!   commits), and writers, relays, their LISTEN connections and the consumer follow
//!   through a multi-host URL.
//!
//! The tests in this binary restart shared services, so they run one at a time (and cargo
//! runs test binaries one after another).
//!
//! ```sh
//! cargo test --all-features --test faults                                    # CI tier
//! cargo test --release --all-features --test faults -- --ignored --nocapture # long tiers
//! ```
#![cfg(feature = "cli")]

#[path = "../common/mod.rs"]
mod common;

mod broker;
mod failover;
mod harness;
mod startup;
mod suite;

use std::time::Duration;

use harness::Tier;

/// The broker a run of the suite publishes to and consumes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    RabbitMq,
    Nats,
    Kafka,
}

/// Tests here restart PostgreSQL and the broker: one at a time (a test that panics releases
/// it as it unwinds).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fault_suite_ci_tier() {
    if !local_tools("fault_suite_ci_tier", Kind::RabbitMq) {
        return;
    }
    let _serial = SERIAL.lock().await;
    suite::run(Kind::RabbitMq, ci_tier()).await;
}

/// The NATS tier: nats-server is cut off, restarted mid-run and stopped for longer than
/// `max_attempts × backoff max`; nothing is lost and nothing but the poison dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fault_suite_ci_tier_nats() {
    if !local_tools("fault_suite_ci_tier_nats", Kind::Nats) {
        return;
    }
    let _serial = SERIAL.lock().await;
    suite::run(Kind::Nats, ci_tier()).await;
}

/// The Kafka tier: a Tansu of the run's own is cut off, paused for a second and paused for
/// longer than `max_attempts × backoff max`; nothing is lost and nothing but the poison
/// dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fault_suite_ci_tier_kafka() {
    if !local_tools("fault_suite_ci_tier_kafka", Kind::Kafka) {
        return;
    }
    let _serial = SERIAL.lock().await;
    suite::run(Kind::Kafka, ci_tier()).await;
}

/// PostgreSQL fails over once mid-run: relays, LISTEN connections, writers and the consumer
/// follow to the promoted replica; nothing is lost, nothing published twice beyond the
/// bound, order kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fault_suite_failover_ci_tier() {
    if !local_tools("fault_suite_failover_ci_tier", Kind::RabbitMq)
        || !common::services::needs("fault_suite_failover_ci_tier", common::cluster::missing())
    {
        return;
    }
    let _serial = SERIAL.lock().await;
    failover::run(failover_ci_tier(), failover::Replication::Synchronous).await;
}

/// PostgreSQL fails over once mid-run to an asynchronous replica, the old primary taking
/// commits for three seconds more that the new primary never sees: the relays finish the
/// tick they opened there, and the new primary has the tick's start only. The relays find
/// the log's cursor behind where they left it and read on from there: every message the
/// new primary holds is delivered, in order, and nothing stalls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fault_suite_async_failover_ci_tier() {
    if !local_tools("fault_suite_async_failover_ci_tier", Kind::RabbitMq)
        || !common::services::needs(
            "fault_suite_async_failover_ci_tier",
            common::cluster::missing(),
        )
    {
        return;
    }
    let _serial = SERIAL.lock().await;
    failover::run(
        failover_ci_tier(),
        failover::Replication::Asynchronous(Duration::from_secs(3)),
    )
    .await;
}

/// A relay and a consumer runner whose start meets PostgreSQL restarting (20 ms, 100 ms
/// and 300 ms in) or down: they wait for their connect timeout and come up; past it they fail with
/// the cause, the relay with exit code 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn start_up_meets_a_postgres_restart() {
    if !local_tools("start_up_meets_a_postgres_restart", Kind::RabbitMq) {
        return;
    }
    let _serial = SERIAL.lock().await;
    startup::run().await;
}

/// Whether the servers this test drives are the local ones (not containers, which their
/// tools cannot drive); says why it is skipped if not.
fn local_tools(test: &str, kind: Kind) -> bool {
    use common::services::Service;
    match kind {
        Kind::RabbitMq => {
            common::services::local_tools_for(test, &[Service::Postgres, Service::RabbitMq])
        }
        Kind::Nats => common::services::local_tools_for(test, &[Service::Postgres, Service::Nats]),
        // A Tansu of the run's own.
        Kind::Kafka => {
            common::services::local_tools_for(test, &[Service::Postgres])
                && common::services::needs(test, common::kafka::Tansu::missing())
        }
    }
}

fn ci_tier() -> Tier {
    Tier {
        messages: 5_000,
        writers: 4,
        aggregates: 40,
        fault_every: Duration::from_millis(1_500),
        writing: Duration::from_secs(50),
        postgres_restarts: 1,
    }
}

fn failover_ci_tier() -> Tier {
    Tier {
        messages: 2_000,
        writers: 4,
        aggregates: 20,
        fault_every: Duration::ZERO,
        writing: Duration::from_secs(30),
        postgres_restarts: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long tier (about 20 minutes): cargo test --release --all-features --test faults -- --ignored"]
async fn fault_suite_long_tier() {
    if !local_tools("fault_suite_long_tier", Kind::RabbitMq) {
        return;
    }
    let _serial = SERIAL.lock().await;
    suite::run(Kind::RabbitMq, long_tier()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long tier (about 20 minutes): cargo test --release --all-features --test faults -- --ignored"]
async fn fault_suite_long_tier_nats() {
    if !local_tools("fault_suite_long_tier_nats", Kind::Nats) {
        return;
    }
    let _serial = SERIAL.lock().await;
    suite::run(Kind::Nats, long_tier()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long tier (about 20 minutes): cargo test --release --all-features --test faults -- --ignored"]
async fn fault_suite_long_tier_kafka() {
    if !local_tools("fault_suite_long_tier_kafka", Kind::Kafka) {
        return;
    }
    let _serial = SERIAL.lock().await;
    suite::run(Kind::Kafka, long_tier()).await;
}

/// Three failovers over five minutes of writing, a new replica made after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long tier (about 6 minutes): cargo test --release --all-features --test faults -- --ignored"]
async fn fault_suite_long_tier_failover() {
    if !local_tools("fault_suite_long_tier_failover", Kind::RabbitMq)
        || !common::services::needs("fault_suite_long_tier_failover", common::cluster::missing())
    {
        return;
    }
    let _serial = SERIAL.lock().await;
    let tier = Tier {
        messages: 30_000,
        writers: 8,
        aggregates: 200,
        fault_every: Duration::ZERO,
        writing: Duration::from_secs(5 * 60),
        postgres_restarts: 3,
    };
    failover::run(tier, failover::Replication::Synchronous).await;
}

fn long_tier() -> Tier {
    Tier {
        messages: 100_000,
        writers: 8,
        aggregates: 400,
        fault_every: Duration::from_secs(4),
        writing: Duration::from_secs(15 * 60),
        postgres_restarts: 3,
    }
}
