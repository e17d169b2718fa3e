//! NATS fixtures: a JetStream stream of the test's own, capturing a subject prefix of its
//! own, deleted when it drops.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;

pub use super::nats_url;

pub async fn connect() -> async_nats::Client {
    match async_nats::connect(nats_url()).await {
        Ok(client) => client,
        Err(e) => panic!(
            "NATS is not reachable ({e}). Start it with `start-stop-daemon --start --oknodo \
             --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd \
             /var/lib/nats-server -l /var/log/nats-server.log` or point NATS_URL at one."
        ),
    }
}

/// A stream named `name`, capturing `prefix` + `>`, with file storage (it survives a
/// server restart).
pub struct TestStream {
    pub name: String,
    /// Ends with a dot: the publishers' subject prefix.
    pub prefix: String,
    pub client: async_nats::Client,
    pub jetstream: jetstream::Context,
    /// On the shared server (deleted when this drops), not on a server of the test's own.
    shared: bool,
}

impl TestStream {
    pub async fn new() -> TestStream {
        Self::with(|config| config).await
    }

    /// A stream whose configuration `tune` adjusts (limits, say).
    pub async fn with(tune: impl FnOnce(stream::Config) -> stream::Config) -> TestStream {
        let id = super::unique("s");
        Self::create(format!("{id}."), tune).await
    }

    /// A stream capturing `prefix` (which ends with a dot) + `>`.
    pub async fn for_prefix(prefix: &str) -> TestStream {
        Self::create(prefix.to_owned(), |config| config).await
    }

    /// [`TestStream::with`] on the server `client` is connected to, a server of the
    /// test's own (the stream goes with it).
    pub async fn on(
        client: async_nats::Client,
        tune: impl FnOnce(stream::Config) -> stream::Config,
    ) -> TestStream {
        let id = super::unique("s");
        Self::create_on(client, format!("{id}."), tune, false).await
    }

    async fn create(
        prefix: String,
        tune: impl FnOnce(stream::Config) -> stream::Config,
    ) -> TestStream {
        Self::create_on(connect().await, prefix, tune, true).await
    }

    async fn create_on(
        client: async_nats::Client,
        prefix: String,
        tune: impl FnOnce(stream::Config) -> stream::Config,
        shared: bool,
    ) -> TestStream {
        let jetstream = jetstream::new(client.clone());
        let name = prefix.trim_end_matches('.').to_uppercase();
        let config = tune(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}>")],
            storage: stream::StorageType::File,
            ..Default::default()
        });
        create_stream(&jetstream, config).await;
        TestStream {
            name,
            prefix,
            client,
            jetstream,
            shared,
        }
    }

    /// How many messages the stream holds.
    pub async fn stored(&self) -> u64 {
        let mut stream = self.jetstream.get_stream(&self.name).await.expect("stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// A durable pull consumer with explicit acks, `ack_wait` as given.
    pub async fn durable(&self, name: &str, ack_wait: Duration) {
        let stream = self.jetstream.get_stream(&self.name).await.expect("stream");
        stream
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(name.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait,
                ..Default::default()
            })
            .await
            .expect("create consumer");
    }

    /// Every message stored, in stream order: `(subject, headers, payload)`.
    pub async fn messages(&self) -> Vec<async_nats::Message> {
        let stream = self.jetstream.get_stream(&self.name).await.expect("stream");
        let total = self.stored().await as usize;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
            .await
            .expect("ordered consumer");
        let mut messages = consumer.messages().await.expect("messages");
        let mut out = Vec::with_capacity(total);
        while out.len() < total {
            let next = tokio::time::timeout(super::DEADLINE, messages.next())
                .await
                .expect("stored messages arrive")
                .expect("stream open")
                .expect("message");
            out.push(next.message);
        }
        out
    }
}

/// Creates the stream `config` describes. nats-server answers a failure to make the
/// stream's file store with no more than "error creating store for stream" (its cause goes
/// to its own log only), and a loaded server has given that answer for a fresh stream:
/// tried again for up to 20 s, then the panic quotes the server log's warnings.
pub async fn create_stream(jetstream: &jetstream::Context, config: stream::Config) {
    use async_nats::jetstream::context::CreateStreamErrorKind;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let err = match jetstream.create_stream(config.clone()).await {
            Ok(_) => return,
            Err(err) => err,
        };
        let store_failed = matches!(
            err.kind(),
            CreateStreamErrorKind::JetStream(e)
                if e.error_code() == jetstream::ErrorCode::STREAM_CREATE
        );
        if !store_failed || std::time::Instant::now() >= deadline {
            let warnings: Vec<String> = std::fs::read_to_string("/var/log/nats-server.log")
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("[WRN]") || l.contains("[ERR]"))
                .map(str::to_owned)
                .collect();
            let last = &warnings[warnings.len().saturating_sub(10)..];
            panic!("create stream: {err:?}; the local server's last warnings: {last:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        if !self.shared {
            return;
        }
        let name = self.name.clone();
        super::block_on_aside(async move {
            if let Ok(client) = async_nats::connect(nats_url()).await {
                let _ = jetstream::new(client).delete_stream(&name).await;
            }
        });
    }
}

/// The first value of header `name`.
pub fn header<'a>(message: &'a async_nats::Message, name: &str) -> Option<&'a str> {
    message.headers.as_ref()?.get(name).map(|v| v.as_str())
}

/// A nats-server of the test's own, on free loopback ports: JetStream, TLS only (a
/// certificate for `localhost` from a CA of the test's own) and NKey authentication (one
/// user), its monitoring endpoint on another port. Stopped, and its files removed, when
/// dropped.
pub struct TlsNats {
    /// `tls://localhost:<port>`.
    pub url: String,
    /// The CA that signed the server's certificate.
    pub ca: std::path::PathBuf,
    /// The NKey seed of the server's one user.
    pub seed: String,
    pub monitor: u16,
    pub dir: std::path::PathBuf,
    child: std::process::Child,
}

impl TlsNats {
    /// What this machine lacks to start a nats-server of a test's own, if anything.
    pub fn missing() -> Option<String> {
        (!std::path::Path::new("/usr/sbin/nats-server").exists())
            .then(|| "/usr/sbin/nats-server is missing: apt-get install -y nats-server".to_owned())
    }

    pub fn start() -> TlsNats {
        let dir = std::env::temp_dir().join(super::unique("outbox_tls_nats"));
        std::fs::create_dir_all(dir.join("js")).unwrap();
        let ca = super::tls::Ca::new("diesel-outbox test CA");
        let server = ca.server(&["localhost"]);
        let cert = super::tls::write(&dir, "server.pem", &server.cert);
        let key = super::tls::write(&dir, "server.key", &server.key);
        let ca_file = super::tls::write(&dir, "ca.pem", &ca.cert());
        let user = nkeys::KeyPair::new_user();
        let [port, monitor] = super::cluster::free_ports();
        let config = format!(
            "listen: \"127.0.0.1:{port}\"\nhttp: \"127.0.0.1:{monitor}\"\n\
             jetstream {{ store_dir: \"{js}\" }}\n\
             tls {{ cert_file: \"{cert}\", key_file: \"{key}\", timeout: 5 }}\n\
             authorization {{ users: [ {{ nkey: \"{public}\" }} ] }}\n",
            js = dir.join("js").display(),
            cert = cert.display(),
            key = key.display(),
            public = user.public_key(),
        );
        let config_file = super::tls::write(&dir, "nats.conf", &config);
        let child = std::process::Command::new("/usr/sbin/nats-server")
            .arg("-c")
            .arg(&config_file)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start /usr/sbin/nats-server");
        // The monitor's port opens before JetStream is up, the clients' port after it.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while [monitor, port]
            .iter()
            .any(|p| std::net::TcpStream::connect(("127.0.0.1", *p)).is_err())
        {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        TlsNats {
            url: format!("tls://localhost:{port}"),
            ca: ca_file,
            seed: user.seed().unwrap(),
            monitor,
            dir,
            child,
        }
    }

    /// A client of the test's own, over TLS, as the NKey user.
    pub async fn client(&self) -> async_nats::Client {
        use async_nats::rustls;
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        // The provider named: the test build has both of rustls's compiled in.
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        async_nats::ConnectOptions::new()
            .nkey(self.seed.clone())
            .tls_client_config(config)
            .require_tls(true)
            .connect(&self.url)
            .await
            .expect("connect to the test's nats-server")
    }

    /// Creates a stream `name` capturing `prefix` + `>`, and a durable pull consumer
    /// `durable` of it.
    pub async fn stream(&self, name: &str, prefix: &str, durable: &str) -> jetstream::Context {
        let js = jetstream::new(self.client().await);
        let stream = js
            .create_stream(stream::Config {
                name: name.to_owned(),
                subjects: vec![format!("{prefix}>")],
                ..Default::default()
            })
            .await
            .expect("create stream");
        stream
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(durable.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ..Default::default()
            })
            .await
            .expect("create consumer");
        js
    }

    /// The server's `/connz`: the TLS version of each connection whose name is `name`
    /// (empty for a connection in the clear).
    pub fn tls_versions(&self, name: &str) -> Vec<String> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.monitor)).unwrap();
        write!(stream, "GET /connz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let connz: serde_json::Value = serde_json::from_str(body).expect("/connz is JSON");
        connz["connections"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["name"] == name)
            .map(|c| c["tls_version"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

impl Drop for TlsNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
