//! Behind PgBouncer in transaction mode: a real `pgbouncer` process of the test's own in
//! front of the real PostgreSQL, and the relay on a direct connection beside it.

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::{DEADLINE, TestSchema, database_url, eventually, spawn_relay, stop_relay};
use diesel::QueryableByName;
use diesel::sql_types::Integer;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use diesel_outbox::{
    Error, Message, Outbox, PgPool, PublishError, Record, establish_without_statement_cache,
    publisher_fn,
};

/// Where Debian's `pgbouncer` package installs the binary.
const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// Server connections PgBouncer opens to PostgreSQL: fewer than the clients, so that it
/// hands each client's transactions to whichever server connection is free.
const SERVER_CONNECTIONS: u32 = 3;

/// A `pgbouncer` process in transaction mode on a free loopback port, in front of the
/// database of [`database_url`]; killed, and its directory removed, on drop.
struct PgBouncer {
    child: Child,
    dir: PathBuf,
    port: u16,
}

fn binary() -> PathBuf {
    std::env::var_os("PGBOUNCER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(PGBOUNCER))
}

/// False (after saying why on stderr) on a machine without PgBouncer, outside CI (see
/// `services::needs`).
fn runnable(test: &str) -> bool {
    let missing = (!binary().exists()).then(|| {
        format!(
            "{} is missing: install PgBouncer (Debian: `apt-get install -y pgbouncer`; \
             .ci/run does it), or set PGBOUNCER to its path",
            binary().display()
        )
    });
    common::services::needs(test, missing)
}

impl PgBouncer {
    fn start() -> PgBouncer {
        let binary = binary();
        assert!(
            binary.exists(),
            "{} is missing: install PgBouncer (Debian: `apt-get install -y pgbouncer`; \
             .ci/run does it), or set PGBOUNCER to its path",
            binary.display()
        );
        let upstream = Upstream::of(&database_url());
        let dir = std::env::temp_dir().join(common::unique("pgbouncer"));
        std::fs::create_dir(&dir).expect("create the pgbouncer directory");
        let port = free_port();
        let ini = dir.join("pgbouncer.ini");
        let users = dir.join("users.txt");
        std::fs::write(&users, format!("\"{}\" \"\"\n", upstream.user)).unwrap();
        std::fs::write(
            &ini,
            format!(
                "[databases]\n\
                 {db} = host={host} port={up_port} dbname={db} user={user}\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {users}\n\
                 pool_mode = transaction\n\
                 default_pool_size = {SERVER_CONNECTIONS}\n\
                 max_client_conn = 200\n\
                 ignore_startup_parameters = extra_float_digits,options\n",
                db = upstream.database,
                host = upstream.host,
                up_port = upstream.port,
                user = upstream.user,
                users = users.display(),
            ),
        )
        .unwrap();
        // PgBouncer refuses to run as root; `-u` makes it drop to the database's owner.
        let mut command = Command::new(&binary);
        if running_as_root() {
            command.args(["-u", "postgres"]);
        }
        let log = std::fs::File::create(dir.join("pgbouncer.log")).unwrap();
        let child = command
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start pgbouncer");
        let mut bouncer = PgBouncer { child, dir, port };
        bouncer.wait_listening(Duration::from_secs(20));
        bouncer
    }

    /// The URL of the database through PgBouncer.
    fn url(&self) -> String {
        let upstream = Upstream::of(&database_url());
        format!(
            "postgres://{}@127.0.0.1:{}/{}",
            upstream.user, self.port, upstream.database
        )
    }

    fn log(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = std::fs::File::open(self.dir.join("pgbouncer.log")) {
            let _ = file.read_to_string(&mut text);
        }
        text
    }

    fn wait_listening(&mut self, timeout: Duration) {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("pgbouncer exited with {status}:\n{}", self.log());
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not listen on {addr} within {timeout:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A port nobody listens on now: bound, read, and released.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().unwrap().port()
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Uid:"))?.to_owned();
            Some(line.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// The parts of a `postgres://user@host:port/database` URL PgBouncer's entry needs.
struct Upstream {
    user: String,
    host: String,
    port: u16,
    database: String,
}

impl Upstream {
    fn of(url: &str) -> Upstream {
        fn bad<T>() -> T {
            panic!("DATABASE_URL is not of the form postgres://user@host:port/database")
        }
        let rest = url
            .split_once("://")
            .map(|(_, rest)| rest)
            .unwrap_or_else(bad);
        let (authority, database) = rest.split_once('/').unwrap_or_else(bad);
        let database = database.split('?').next().unwrap_or_default();
        let (user, host_port) = authority.rsplit_once('@').unwrap_or_else(bad);
        let user = user.split(':').next().unwrap_or_default();
        let (host, port) = host_port.rsplit_once(':').unwrap_or((host_port, "5432"));
        Upstream {
            user: user.to_owned(),
            host: host.to_owned(),
            port: port.parse().unwrap_or_else(|_| bad()),
            database: database.to_owned(),
        }
    }
}

/// Tasks working through PgBouncer at once: more than its server connections.
const TASKS: usize = 6;
/// Rounds of every operation each task runs.
const ROUNDS: usize = 5;

/// A pool of `TASKS` connections to `url`, with the statement cache off or (`cached`) on.
async fn pool_through(url: String, cached: bool) -> PgPool {
    let mut config = ManagerConfig::default();
    if !cached {
        config.custom_setup = Box::new(establish_without_statement_cache);
    }
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(url, config);
    PgPool::builder()
        .max_size(TASKS as u32)
        .test_on_check_out(false)
        .build(manager)
        .await
        .expect("pool through pgbouncer")
}

#[derive(QueryableByName)]
struct Backend {
    #[diesel(sql_type = Integer)]
    pid: i32,
}

/// What one task saw.
#[derive(Default)]
struct Seen {
    keys: Vec<String>,
    poison: Vec<String>,
    first_dedupes: usize,
    duplicate_dedupes: usize,
    backends: BTreeSet<i32>,
    errors: Vec<String>,
}

/// One task's workload: in a transaction each round, an enqueue, a batch of two and a
/// poisoned message (and the server's backend pid); a dedupe of a key in one transaction and
/// again in another; then every operation outside any transaction.
async fn workload(pool: PgPool, outbox: Outbox, task: usize) -> Seen {
    let mut seen = Seen::default();
    for round in 0..ROUNDS {
        let mut conn = pool.get().await.expect("a pooled connection");
        let written = conn
            .transaction(async |c| {
                let pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
                    .get_result::<Backend>(c)
                    .await?
                    .pid;
                let one = outbox
                    .enqueue(c, Message::new("pooler.one", format!("{task}/{round}")))
                    .await?;
                let many = outbox
                    .enqueue_many(
                        c,
                        vec![
                            Message::new("pooler.many", "a").aggregate_key(format!("a-{task}")),
                            Message::new("pooler.many", "b").aggregate_key(format!("a-{task}")),
                        ],
                    )
                    .await?;
                let poison = outbox.enqueue(c, Message::new("poison", "x")).await?;
                Ok::<_, Error>((pid, one, many, poison))
            })
            .await;
        match written {
            Ok((pid, one, many, poison)) => {
                seen.backends.insert(pid);
                seen.keys.push(one);
                seen.keys.extend(many);
                seen.poison.push(poison);
            }
            Err(e) => seen.errors.push(format!("enqueue: {e}")),
        }
        let key = format!("delivery-{task}-{round}");
        for _ in 0..2 {
            match conn
                .transaction(async |c| outbox.dedupe(c, "pooler", &key).await)
                .await
            {
                Ok(true) => seen.first_dedupes += 1,
                Ok(false) => seen.duplicate_dedupes += 1,
                Err(e) => seen.errors.push(format!("dedupe: {e}")),
            }
        }
        let day = Duration::from_secs(86_400);
        let ops: [(&str, Result<(), Error>); 5] = [
            ("stats", outbox.stats(&mut conn).await.map(drop)),
            (
                "dead_letters",
                outbox.dead_letters(&mut conn, 10).await.map(drop),
            ),
            (
                "redrive",
                outbox.redrive(&mut conn, &["no-such-key"]).await.map(drop),
            ),
            (
                "purge_sent",
                outbox.purge_sent(&mut conn, day).await.map(drop),
            ),
            (
                "purge_inbox",
                outbox.purge_inbox(&mut conn, day).await.map(drop),
            ),
        ];
        for (name, result) in ops {
            if let Err(e) = result {
                seen.errors.push(format!("{name}: {e}"));
            }
        }
    }
    seen
}

/// Runs [`workload`] on `TASKS` tasks at once and gathers what they saw.
async fn run_workload(pool: &PgPool, outbox: &Outbox) -> Seen {
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| tokio::spawn(workload(pool.clone(), outbox.clone(), task)))
        .collect();
    let mut all = Seen::default();
    for task in tasks {
        let seen = task.await.expect("workload task");
        all.keys.extend(seen.keys);
        all.poison.extend(seen.poison);
        all.first_dedupes += seen.first_dedupes;
        all.duplicate_dedupes += seen.duplicate_dedupes;
        all.backends.extend(seen.backends);
        all.errors.extend(seen.errors);
    }
    all
}

#[tokio::test]
async fn everything_but_the_relay_runs_through_pgbouncer_with_the_statement_cache_off() {
    if !runnable("everything_but_the_relay_runs_through_pgbouncer_with_the_statement_cache_off") {
        return;
    }
    let bouncer = PgBouncer::start();
    let schema = TestSchema::new().await;
    let outbox = Outbox::builder()
        .table(schema.table("outbox"))
        .build()
        .unwrap();
    let pooled = pool_through(bouncer.url(), false).await;
    outbox
        .migrate(&mut pooled.get().await.unwrap())
        .await
        .expect("migrate through pgbouncer");

    // The relay on a direct connection: it publishes everything but poison, which it kills
    // until `poisoning` is off.
    let published: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let poisoning = Arc::new(AtomicBool::new(true));
    let (record, poisoned) = (published.clone(), poisoning.clone());
    let relay = outbox
        .relay(
            common::pool(2).await,
            publisher_fn(move |r: Record| {
                let (record, poisoned) = (record.clone(), poisoned.clone());
                async move {
                    if r.topic == "poison" && AtomicBool::load(&poisoned, Ordering::SeqCst) {
                        return Err(PublishError::permanent("poison"));
                    }
                    record.lock().unwrap().insert(r.key);
                    Ok(())
                }
            }),
        )
        .build()
        .unwrap();
    let (stop, task) = spawn_relay(relay);

    let seen = run_workload(&pooled, &outbox).await;
    assert!(
        seen.errors.is_empty(),
        "errors through pgbouncer: {:?}",
        seen.errors
    );
    assert!(
        seen.backends.len() > 1,
        "pgbouncer kept every task on one server connection: {:?}",
        seen.backends
    );
    assert_eq!(seen.first_dedupes, TASKS * ROUNDS);
    assert_eq!(seen.duplicate_dedupes, TASKS * ROUNDS);
    let keys: BTreeSet<String> = seen.keys.iter().cloned().collect();
    let poison: BTreeSet<String> = seen.poison.iter().cloned().collect();
    assert_eq!(keys.len(), TASKS * ROUNDS * 3);
    assert_eq!(poison.len(), TASKS * ROUNDS);

    let mut conn = pooled.get().await.unwrap();
    let total = (keys.len() + poison.len()) as u64;
    let stats = eventually(DEADLINE, "every message sent or dead", || async {
        let stats = outbox
            .stats(&mut pooled.get().await.unwrap())
            .await
            .unwrap();
        (stats.sent + stats.dead == total).then_some(stats)
    })
    .await;
    assert_eq!(
        (stats.pending, stats.in_flight, stats.sent, stats.dead),
        (0, 0, keys.len() as u64, poison.len() as u64)
    );
    assert_eq!(*published.lock().unwrap(), keys);
    let dead: BTreeSet<String> = outbox
        .dead_letters(&mut conn, 1_000)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.key)
        .collect();
    assert_eq!(dead, poison);

    poisoning.store(false, Ordering::SeqCst);
    let redriven: BTreeSet<String> = outbox
        .redrive(&mut conn, &[])
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(redriven, poison);
    let everything: BTreeSet<String> = keys.union(&poison).cloned().collect();
    eventually(DEADLINE, "the redriven messages published", || async {
        (*published.lock().unwrap() == everything).then_some(())
    })
    .await;
    let stats = eventually(DEADLINE, "every message recorded sent", || async {
        let stats = outbox
            .stats(&mut pooled.get().await.unwrap())
            .await
            .unwrap();
        (stats.sent == total).then_some(stats)
    })
    .await;
    assert_eq!((stats.pending, stats.in_flight, stats.dead), (0, 0, 0));
    assert_eq!(
        outbox.purge_sent(&mut conn, Duration::ZERO).await.unwrap(),
        total
    );
    assert_eq!(
        outbox.purge_inbox(&mut conn, Duration::ZERO).await.unwrap(),
        (TASKS * ROUNDS) as u64
    );
    stop_relay(stop, task).await;
}

#[tokio::test]
async fn with_the_default_statement_cache_pgbouncer_loses_prepared_statements() {
    if !runnable("with_the_default_statement_cache_pgbouncer_loses_prepared_statements") {
        return;
    }
    let bouncer = PgBouncer::start();
    let schema = TestSchema::new().await;
    let outbox = Outbox::builder()
        .table(schema.table("outbox"))
        .build()
        .unwrap();
    outbox.migrate(&mut common::connect().await).await.unwrap();
    let pooled = pool_through(bouncer.url(), true).await;
    // Statements cached on one server connection are used on another sooner or later.
    let deadline = Instant::now() + DEADLINE;
    let errors = loop {
        let seen = run_workload(&pooled, &outbox).await;
        if !seen.errors.is_empty() {
            break seen.errors;
        }
        assert!(
            Instant::now() < deadline,
            "the cached statements never failed through pgbouncer"
        );
    };
    assert!(
        errors.iter().all(|e| e.contains("prepared statement \"s")
            && (e.contains("does not exist") || e.contains("already exists"))),
        "{errors:?}"
    );
}

#[cfg(feature = "cli")]
#[tokio::test]
async fn the_cli_runs_through_pgbouncer_with_no_statement_cache() {
    if !runnable("the_cli_runs_through_pgbouncer_with_no_statement_cache") {
        return;
    }
    const BIN: &str = env!("CARGO_BIN_EXE_diesel-outbox");
    let bouncer = PgBouncer::start();
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    let cli = |args: &[&str], no_statement_cache: &str| {
        Command::new(BIN)
            .args(["--table", &table])
            .args(args)
            .env("DATABASE_URL", bouncer.url())
            .env("OUTBOX_NO_STATEMENT_CACHE", no_statement_cache)
            .output()
            .expect("run diesel-outbox")
    };
    for command in [
        &["migrate"][..],
        &["stats"],
        &["dead"],
        &["redrive", "--all"],
        &["discard", "--all"],
        &["purge"],
    ] {
        let out = cli(command, "true");
        assert!(
            out.status.success(),
            "{command:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = cli(&["stats"], "maybe");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("maybe") && err.contains("--no-statement-cache"),
        "{err}"
    );
}
