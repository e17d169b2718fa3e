//! Where PostgreSQL, RabbitMQ and NATS come from, for the tests, the examples and the
//! benchmark alike.
//!
//! Each service is looked for on its own, once per process, in this order:
//!
//! 1. the URL in its environment variable (`DATABASE_URL`, `AMQP_URL`, `NATS_URL`), if set
//!    and not empty;
//! 2. else the local default, if something accepts a TCP connection on its port within
//!    [`LOCAL_TIMEOUT`] ([`Service::default_url`]);
//! 3. else a container of [`Service::image`] started through testcontainers, if a Docker
//!    engine answers;
//! 4. else an error that names what to start or set ([`Unavailable`]).
//!
//! # Containers and their removal
//!
//! A container is started, kept and removed on a thread of its own with its own Tokio
//! runtime, so [`url`] works from plain code, from `Drop`, and from inside a runtime. It is
//! removed:
//!
//! - when the [`Containers`] guard from [`urls`] drops (the examples and the benchmark hold
//!   one until `main` ends): the removal is awaited before the drop returns;
//! - otherwise (a test binary, whose process-wide state is never dropped), when the process
//!   ends, however it ends (a normal exit, a panic, Ctrl-C, `SIGKILL`): the first container
//!   of a process spawns a reaper, `sh` running `docker rm --force --volumes` on the ids
//!   the process wrote to its standard input once that pipe closes, which the kernel does
//!   when the process ends. The reaper ignores `SIGINT`, `SIGTERM` and `SIGHUP`, so the
//!   Ctrl-C that stops the process does not stop it too.
//!
//! Limits: the reaper needs `sh` and the `docker` command line on `PATH`, talking to the
//! engine testcontainers used (both read `DOCKER_HOST`; a Docker context or
//! `~/.testcontainers.properties` seen by only one of them is not followed by the other).
//! Without them a test binary's containers stay until removed by hand (`docker ps`), while
//! a dropped [`Containers`] guard still removes its own. A process that dies while a
//! container starts, before its id is known, leaves that one. `TESTCONTAINERS_COMMAND=keep`
//! keeps every container (no reaper). Each test binary starts its own containers: a
//! `cargo test` run starts one set per binary that needs them.
#![allow(dead_code, unreachable_pub)]

use std::io::Write as _;
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use testcontainers_modules::testcontainers::bollard::errors::Error as BollardError;
use testcontainers_modules::testcontainers::core::client::ClientError;
use testcontainers_modules::testcontainers::core::{IntoContainerPort as _, WaitFor};
use testcontainers_modules::testcontainers::runners::AsyncRunner as _;
use testcontainers_modules::testcontainers::{
    ContainerRequest, Image, ImageExt as _, TestcontainersError,
};

/// How long the local default gets to accept a TCP connection.
pub const LOCAL_TIMEOUT: Duration = Duration::from_millis(500);

/// A service the tests talk to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    Postgres,
    RabbitMq,
    Nats,
}

impl Service {
    pub const ALL: [Service; 3] = [Service::Postgres, Service::RabbitMq, Service::Nats];

    /// The name people know it by.
    pub fn name(self) -> &'static str {
        match self {
            Service::Postgres => "PostgreSQL",
            Service::RabbitMq => "RabbitMQ",
            Service::Nats => "NATS",
        }
    }

    /// The environment variable whose URL comes first.
    pub fn env_var(self) -> &'static str {
        match self {
            Service::Postgres => "DATABASE_URL",
            Service::RabbitMq => "AMQP_URL",
            Service::Nats => "NATS_URL",
        }
    }

    /// Where the local default listens.
    pub fn local_addr(self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port()))
    }

    /// The URL of the local default (no password in any of them but RabbitMQ's well-known
    /// `guest`).
    pub fn default_url(self) -> &'static str {
        match self {
            Service::Postgres => "postgres://postgres@127.0.0.1:5432/test",
            Service::RabbitMq => "amqp://guest:guest@127.0.0.1:5672/%2f",
            Service::Nats => "nats://127.0.0.1:4222",
        }
    }

    /// The image (and tag) a container is started from.
    pub fn image(self) -> &'static str {
        match self {
            Service::Postgres => "postgres:16-alpine",
            Service::RabbitMq => "rabbitmq:3.13-alpine",
            Service::Nats => "nats:2.10 (-js)",
        }
    }

    /// How to start the local default.
    pub fn start_hint(self) -> &'static str {
        match self {
            Service::Postgres => {
                "`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`"
            }
            Service::RabbitMq => "`rabbitmq-server -detached`",
            Service::Nats => "`nats-server -js`",
        }
    }

    fn port(self) -> u16 {
        match self {
            Service::Postgres => 5432,
            Service::RabbitMq => 5672,
            Service::Nats => 4222,
        }
    }

    /// The service's URL at `host:port` (a container's mapped port).
    fn url_at(self, host: &str, port: u16) -> String {
        match self {
            Service::Postgres => format!("postgres://postgres@{host}:{port}/test"),
            Service::RabbitMq => format!("amqp://guest:guest@{host}:{port}/%2f"),
            Service::Nats => format!("nats://{host}:{port}"),
        }
    }
}

/// Where a service's URL came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The environment variable.
    Env,
    /// The local default, which answered.
    Local,
    /// A container this process started.
    Docker,
}

/// A service's URL and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub url: String,
    pub origin: Origin,
}

/// What trying to start a container gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DockerStart {
    /// Running, at this URL.
    Started(String),
    /// No Docker engine answered (no socket, or nothing listening on it): why.
    NoEngine(String),
    /// An engine answered but the container did not start: the error.
    Failed(String),
}

/// No way to reach a service: the message says what to start or set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unavailable(pub String);

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

/// The order of the module docs, over injected facts: `env` is the environment variable's
/// value, `local_answers` probes the local default, `start_in_docker` tries a container.
/// Each fact is asked for only when the ones before it gave nothing.
pub fn choose(
    service: Service,
    env: Option<String>,
    local_answers: impl FnOnce() -> bool,
    start_in_docker: impl FnOnce() -> DockerStart,
) -> Result<Found, Unavailable> {
    if let Some(url) = env.filter(|url| !url.is_empty()) {
        return Ok(Found {
            url,
            origin: Origin::Env,
        });
    }
    if local_answers() {
        return Ok(Found {
            url: service.default_url().to_owned(),
            origin: Origin::Local,
        });
    }
    let (name, var, addr, hint) = (
        service.name(),
        service.env_var(),
        service.local_addr(),
        service.start_hint(),
    );
    match start_in_docker() {
        DockerStart::Started(url) => Ok(Found {
            url,
            origin: Origin::Docker,
        }),
        DockerStart::NoEngine(why) => Err(Unavailable(format!(
            "{name} is not reachable at {addr} and no Docker engine answered ({why}): \
             start {name} ({hint}), or set {var}, or start Docker"
        ))),
        DockerStart::Failed(error) => Err(Unavailable(format!(
            "{name} is not reachable at {addr} and its container ({image}) did not start \
             ({error}): start {name} ({hint}), or set {var}, or fix Docker",
            image = service.image()
        ))),
    }
}

/// Whether something accepts a TCP connection at `addr` within [`LOCAL_TIMEOUT`].
pub fn answers(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, LOCAL_TIMEOUT).is_ok()
}

/// Where each service was found, once it was.
static ORIGINS: [OnceLock<Origin>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];

fn index(service: Service) -> usize {
    Service::ALL
        .iter()
        .position(|s| *s == service)
        .expect("a service")
}

/// Whether `service` runs in a container this process started. Tests that drive the local
/// servers' own tools (`pg_ctlcluster`, `rabbitmqctl`, `start-stop-daemon`) cannot run
/// against one.
pub fn in_docker(service: Service) -> bool {
    try_url(service).is_ok() && ORIGINS[index(service)].get() == Some(&Origin::Docker)
}

/// True, or false after saying on stderr why `test` is skipped, when any service it
/// drives with the local servers' own tools runs in a container.
/// Whether `test` can run: `missing` says what this machine lacks for it (a program, and how
/// to install it), if anything. Then the test is skipped, saying so on stderr, except under
/// `CI=true`, where `.ci/run` installs everything and a skip would hide a failure: there it
/// fails.
pub fn needs(test: &str, missing: Option<String>) -> bool {
    let Some(missing) = missing else {
        return true;
    };
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: {missing} (under CI=true no test is skipped)"
    );
    eprintln!("{test}: skipped: {missing}");
    false
}

pub fn local_tools_for(test: &str, services: &[Service]) -> bool {
    match services.iter().find(|s| in_docker(**s)) {
        None => true,
        Some(s) => {
            eprintln!(
                "{test}: skipped: it drives the local {} with its own tools, and {} runs in \
                 a container here",
                s.name(),
                s.name()
            );
            false
        }
    }
}

/// `service`'s URL, found once per process in the order of the module docs.
pub fn try_url(service: Service) -> Result<String, Unavailable> {
    static FOUND: [OnceLock<Result<String, Unavailable>>; 3] =
        [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let index = index(service);
    FOUND[index]
        .get_or_init(|| {
            let found = choose(
                service,
                std::env::var(service.env_var()).ok(),
                || answers(service.local_addr()),
                || start_in_docker(service),
            )?;
            let _ = ORIGINS[index].set(found.origin);
            if found.origin == Origin::Docker {
                eprintln!(
                    "{}: {} is not set and nothing answers at {}: started {} in Docker, at {}",
                    service.name(),
                    service.env_var(),
                    service.local_addr(),
                    service.image(),
                    without_credentials(&found.url),
                );
            }
            Ok(found.url)
        })
        .clone()
}

/// `service`'s URL, or a panic whose message says what to start or set (for test fixtures).
pub fn url(service: Service) -> String {
    try_url(service).unwrap_or_else(|e| panic!("{e}"))
}

/// The URLs of `services` and the guard that removes the containers started for them when
/// it drops (keep it until the end of `main`).
pub fn urls<const N: usize>(
    services: [Service; N],
) -> Result<(Containers, [String; N]), Unavailable> {
    // First, so that the containers already started go if a later service is unavailable.
    let containers = Containers(());
    let mut found = Vec::with_capacity(N);
    for service in services {
        found.push(try_url(service)?);
    }
    let found = found.try_into().expect("one URL per service");
    Ok((containers, found))
}

/// Removes, when it drops, every container this process started (their URLs are dead from
/// then on).
#[must_use = "the containers are removed when this drops"]
pub struct Containers(());

impl Drop for Containers {
    fn drop(&mut self) {
        let keepers = std::mem::take(&mut *KEEPERS.lock().unwrap_or_else(PoisonError::into_inner));
        for (release, thread) in keepers {
            let _ = release.send(());
            let _ = thread.join();
        }
    }
}

/// The threads that keep a container each, and what tells them to remove it.
static KEEPERS: Mutex<
    Vec<(
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<()>,
    )>,
> = Mutex::new(Vec::new());

/// Starts `service` in a container, on a thread of its own that keeps it until
/// [`Containers`] drops (or the process ends, see the module docs).
pub fn start_in_docker(service: Service) -> DockerStart {
    let (started, outcome) = std::sync::mpsc::channel();
    let (release, released) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new()
        .name(format!("{} container", service.name()))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = started.send(DockerStart::Failed(format!("no Tokio runtime: {e}")));
                    return;
                }
            };
            runtime.block_on(async move {
                match service {
                    Service::Postgres => {
                        let image = testcontainers_modules::postgres::Postgres::default()
                            .with_host_auth()
                            .with_db_name("test")
                            .with_tag("16-alpine");
                        keep(service, image, started, released).await;
                    }
                    Service::RabbitMq => {
                        // The module waits for the management image's plugin count.
                        let image = testcontainers_modules::rabbitmq::RabbitMq::default()
                            .with_tag("3.13-alpine")
                            .with_ready_conditions(vec![WaitFor::message_on_stdout(
                                "Server startup complete",
                            )]);
                        keep(service, image, started, released).await;
                    }
                    Service::Nats => {
                        let image = testcontainers_modules::nats::Nats::default()
                            .with_tag("2.10")
                            .with_cmd(["-js"]);
                        keep(service, image, started, released).await;
                    }
                }
            });
        });
    let thread = match thread {
        Ok(thread) => thread,
        Err(e) => return DockerStart::Failed(format!("no thread to keep the container: {e}")),
    };
    let outcome = outcome.recv().unwrap_or_else(|_| {
        DockerStart::Failed("the thread starting the container stopped".to_owned())
    });
    if matches!(outcome, DockerStart::Started(_)) {
        KEEPERS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((release, thread));
    } else {
        let _ = thread.join();
    }
    outcome
}

/// Starts `request`, reports how that went on `started`, then keeps the container until
/// `released` fires (or its sender drops) and removes it.
async fn keep<I: Image>(
    service: Service,
    request: ContainerRequest<I>,
    started: std::sync::mpsc::Sender<DockerStart>,
    released: tokio::sync::oneshot::Receiver<()>,
) {
    let container = match request.start().await {
        Ok(container) => container,
        Err(e) => {
            let _ = started.send(classify(&e));
            return;
        }
    };
    watch(container.id());
    let address = async {
        let host = container.get_host().await?;
        let port = container.get_host_port_ipv4(service.port().tcp()).await?;
        Ok::<_, TestcontainersError>((host.to_string(), port))
    }
    .await;
    match address {
        Ok((host, port)) => {
            let _ = started.send(DockerStart::Started(service.url_at(&host, port)));
            let _ = released.await;
        }
        Err(e) => {
            let _ = started.send(DockerStart::Failed(e.to_string()));
        }
    }
    // Dropped instead, the container stays under `TESTCONTAINERS_COMMAND=keep`.
    if !keeps_containers() {
        let _ = container.rm().await;
    }
}

/// Whether `TESTCONTAINERS_COMMAND=keep` asks to keep every container.
fn keeps_containers() -> bool {
    std::env::var("TESTCONTAINERS_COMMAND").is_ok_and(|c| c.trim() == "keep")
}

/// Tells "no Docker engine answered" (no socket; a socket, or a TCP address, nobody listens
/// on) from the other ways a start fails.
pub fn classify(error: &TestcontainersError) -> DockerStart {
    let TestcontainersError::Client(client) = error else {
        return DockerStart::Failed(error.to_string());
    };
    let bollard = match client {
        ClientError::Init(BollardError::SocketNotFoundError(path)) => {
            return DockerStart::NoEngine(format!("no Docker socket at {path}"));
        }
        ClientError::Init(e)
        | ClientError::PullImage { err: e, .. }
        | ClientError::ListContainers(e)
        | ClientError::CreateContainer(e)
        | ClientError::StartContainer(e)
        | ClientError::InspectContainer(e)
        | ClientError::CreateNetwork(e)
        | ClientError::InspectNetwork(e)
        | ClientError::ListNetworks(e) => e,
        _ => return DockerStart::Failed(error.to_string()),
    };
    // `ClientError` does not name its Bollard error as its source: start from that one.
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(bollard);
    while let Some(e) = cause {
        let io = match e.downcast_ref::<BollardError>() {
            Some(BollardError::IOError { err }) => Some(err),
            _ => e.downcast_ref::<std::io::Error>(),
        };
        if let Some(io) = io
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            )
        {
            return DockerStart::NoEngine(format!("connecting to the Docker socket: {io}"));
        }
        cause = e.source();
    }
    DockerStart::Failed(error.to_string())
}

/// `url` without its user and password, to be printed.
pub fn without_credentials(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(a URL)".to_owned();
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    format!("{scheme}://{host}{}", &rest[end..])
}

/// The reaper's script: ignores the signals that stop the process, reads container ids
/// (one a line) until its standard input closes, then removes those containers.
pub const REAPER_SCRIPT: &str = "trap '' INT TERM HUP; ids=$(cat); \
     [ -z \"$ids\" ] || exec docker rm --force --volumes $ids >/dev/null 2>&1";

/// The reaper's command (`sh -c REAPER_SCRIPT`), to be given to [`spawn_reaper`].
pub fn reaper_command() -> Command {
    let mut command = Command::new("sh");
    command.arg("-c").arg(REAPER_SCRIPT);
    command
}

/// Spawns `command` with a piped standard input and no output.
pub fn spawn_reaper(mut command: Command) -> std::io::Result<Child> {
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
}

/// Hands container `id` to this process's reaper (spawned by the first call).
fn watch(id: &str) {
    static REAPER: Mutex<Option<ChildStdin>> = Mutex::new(None);
    if keeps_containers() {
        return;
    }
    let mut reaper = REAPER.lock().unwrap_or_else(PoisonError::into_inner);
    if reaper.is_none() {
        *reaper = spawn_reaper(reaper_command())
            .ok()
            .and_then(|mut child| child.stdin.take());
    }
    if let Some(stdin) = reaper.as_mut() {
        let _ = writeln!(stdin, "{id}").and_then(|()| stdin.flush());
    }
}
