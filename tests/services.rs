//! Where the services come from (tests/common/services.rs): the order, the messages, the
//! Docker start path without an engine, and the reaper that removes a process's containers.

mod common;

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::services::{self, DockerStart, Found, Origin, Service, Unavailable, choose};
use testcontainers_modules::testcontainers::TestcontainersError;
use testcontainers_modules::testcontainers::bollard::errors::Error as BollardError;
use testcontainers_modules::testcontainers::core::client::ClientError;

fn never_probed() -> bool {
    panic!("the local default was probed")
}

fn never_started() -> DockerStart {
    panic!("a container was started")
}

#[test]
fn the_environment_variable_comes_first() {
    for service in Service::ALL {
        let url = format!("{}://elsewhere:1/x", service.name());
        let found = choose(service, Some(url.clone()), never_probed, never_started).unwrap();
        assert_eq!(
            found,
            Found {
                url,
                origin: Origin::Env
            }
        );
    }
}

#[test]
fn an_empty_environment_variable_is_unset() {
    let found = choose(
        Service::Postgres,
        Some(String::new()),
        || true,
        never_started,
    )
    .unwrap();
    assert_eq!(found.origin, Origin::Local);
}

#[test]
fn the_local_default_comes_next_when_it_answers() {
    for service in Service::ALL {
        let found = choose(service, None, || true, never_started).unwrap();
        assert_eq!(
            found,
            Found {
                url: service.default_url().to_owned(),
                origin: Origin::Local
            }
        );
    }
}

#[test]
fn a_container_comes_last() {
    let found = choose(
        Service::Nats,
        None,
        || false,
        || DockerStart::Started("nats://localhost:32768".into()),
    )
    .unwrap();
    assert_eq!(
        found,
        Found {
            url: "nats://localhost:32768".into(),
            origin: Origin::Docker
        }
    );
}

#[test]
fn no_docker_engine_is_a_message_that_says_what_to_start_or_set() {
    for (service, address, hint) in [
        (Service::Postgres, "127.0.0.1:5432", "pg_ctlcluster"),
        (
            Service::RabbitMq,
            "127.0.0.1:5672",
            "rabbitmq-server -detached",
        ),
        (Service::Nats, "127.0.0.1:4222", "nats-server -js"),
    ] {
        let Unavailable(message) = choose(
            service,
            None,
            || false,
            || DockerStart::NoEngine("no Docker socket at /var/run/docker.sock".into()),
        )
        .unwrap_err();
        for part in [
            &format!("{} is not reachable at {address}", service.name()),
            "no Docker engine answered (no Docker socket at /var/run/docker.sock)",
            hint,
            &format!("set {}", service.env_var()),
            "start Docker",
        ] {
            assert!(message.contains(part), "{part:?} not in {message:?}");
        }
    }
}

#[test]
fn a_container_that_does_not_start_is_a_message_with_its_error() {
    let Unavailable(message) = choose(
        Service::RabbitMq,
        None,
        || false,
        || DockerStart::Failed("failed to pull the image".into()),
    )
    .unwrap_err();
    for part in [
        "RabbitMQ is not reachable at 127.0.0.1:5672",
        "rabbitmq:3.13-alpine",
        "failed to pull the image",
        "set AMQP_URL",
    ] {
        assert!(message.contains(part), "{part:?} not in {message:?}");
    }
}

#[test]
fn a_missing_socket_and_a_refused_one_are_no_engine_and_the_rest_a_failure() {
    let missing = TestcontainersError::Client(ClientError::Init(
        BollardError::SocketNotFoundError("/var/run/docker.sock".into()),
    ));
    assert_eq!(
        services::classify(&missing),
        DockerStart::NoEngine("no Docker socket at /var/run/docker.sock".into())
    );
    let refused =
        TestcontainersError::Client(ClientError::CreateContainer(BollardError::IOError {
            err: std::io::ErrorKind::ConnectionRefused.into(),
        }));
    assert!(matches!(
        services::classify(&refused),
        DockerStart::NoEngine(why) if why.contains("refused")
    ));
    let denied = TestcontainersError::Client(ClientError::CreateContainer(BollardError::IOError {
        err: std::io::ErrorKind::PermissionDenied.into(),
    }));
    assert!(matches!(
        services::classify(&denied),
        DockerStart::Failed(_)
    ));
}

#[test]
fn printed_urls_carry_no_credentials() {
    assert_eq!(
        services::without_credentials("amqp://guest:secret@localhost:32768/%2f"),
        "amqp://localhost:32768/%2f"
    );
    assert_eq!(
        services::without_credentials("postgres://u:p@a@db:5432/test?sslmode=disable"),
        "postgres://db:5432/test?sslmode=disable"
    );
    assert_eq!(
        services::without_credentials("nats://127.0.0.1:4222"),
        "nats://127.0.0.1:4222"
    );
    assert_eq!(services::without_credentials("secret"), "(a URL)");
}

/// Set in a child process of this binary, which then runs one test's body.
const CHILD: &str = "SERVICES_TEST_CHILD";

fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs test `name` of this binary in a child process with `envs`; its output.
fn child(name: &str, envs: &[(&str, &str)]) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .envs(envs.iter().copied());
    command
}

fn run_child(name: &str, envs: &[(&str, &str)]) {
    let output = child(name, envs).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "child {name}: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The real start path, where no Docker engine is: the clear message, not a panic.
fn docker_start_gives_the_clear_message() {
    for service in [Service::Postgres, Service::Nats] {
        let Unavailable(message) = choose(
            service,
            None,
            || false,
            || services::start_in_docker(service),
        )
        .unwrap_err();
        assert!(
            message.contains("no Docker engine answered") && message.contains("start Docker"),
            "{message}"
        );
        println!("{message}");
    }
}

#[test]
fn the_docker_start_without_a_socket_is_the_clear_message() {
    if in_child() {
        return docker_start_gives_the_clear_message();
    }
    run_child(
        "the_docker_start_without_a_socket_is_the_clear_message",
        &[("DOCKER_HOST", "unix:///nonexistent/docker.sock")],
    );
}

#[test]
fn the_docker_start_on_a_dead_socket_is_the_clear_message() {
    if in_child() {
        return docker_start_gives_the_clear_message();
    }
    let dir = temp_dir("dead");
    let socket = dir.join("docker.sock");
    // Bound, then closed: the file stays and connecting to it is refused.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    run_child(
        "the_docker_start_on_a_dead_socket_is_the_clear_message",
        &[("DOCKER_HOST", &format!("unix://{}", socket.display()))],
    );
}

/// A directory of this test's own.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(common::unique(&format!("services_{name}")));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A `docker` that writes its arguments to `log`, first on `PATH`.
fn fake_docker(dir: &Path) -> (String, PathBuf) {
    use std::os::unix::fs::PermissionsExt as _;
    let log = dir.join("docker.log");
    let docker = dir.join("docker");
    std::fs::write(
        &docker,
        format!("#!/bin/sh\necho \"$@\" >> '{}'\n", log.display()),
    )
    .unwrap();
    std::fs::set_permissions(&docker, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap());
    (path, log)
}

/// What the fake docker logged, once it wrote a whole line (or what is there after a few
/// seconds).
fn logged(log: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.ends_with('\n') || Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until process `pid` ignores SIGINT (the reaper's `trap` ran).
fn ignores_sigint(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let ignored = status
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .unwrap_or(0);
        // SIGINT is signal 2: bit 1.
        if ignored & (1 << 1) != 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the reaper never ignored SIGINT");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn the_reaper_removes_the_ids_it_was_given_when_its_input_closes() {
    let dir = temp_dir("reaper");
    let (path, log) = fake_docker(&dir);
    let mut command = services::reaper_command();
    command.env("PATH", path);
    let mut reaper = services::spawn_reaper(command).unwrap();
    let mut stdin = reaper.stdin.take().unwrap();
    writeln!(stdin, "c1").unwrap();
    writeln!(stdin, "c2").unwrap();
    // Ctrl-C reaches the whole process group: the reaper outlives it.
    ignores_sigint(reaper.id());
    let status = Command::new("kill")
        .args(["-INT", &reaper.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    std::thread::sleep(Duration::from_millis(100));
    assert!(reaper.try_wait().unwrap().is_none(), "SIGINT stopped it");
    assert!(!log.exists(), "removed before its input closed");
    drop(stdin);
    assert!(reaper.wait().unwrap().success());
    assert_eq!(logged(&log), "rm --force --volumes c1 c2\n");
}

#[test]
fn the_reaper_without_ids_removes_nothing() {
    let dir = temp_dir("idle");
    let (path, log) = fake_docker(&dir);
    let mut command = services::reaper_command();
    command.env("PATH", path);
    let mut reaper = services::spawn_reaper(command).unwrap();
    drop(reaper.stdin.take());
    assert!(reaper.wait().unwrap().success());
    assert!(!log.exists());
}

#[test]
fn the_reaper_removes_the_ids_of_a_process_that_was_killed() {
    if in_child() {
        let mut command = services::reaper_command();
        command.env("PATH", std::env::var("FAKE_PATH").unwrap());
        #[allow(clippy::zombie_processes)] // It is meant to outlive this process.
        let mut reaper = services::spawn_reaper(command).unwrap();
        let mut stdin = reaper.stdin.take().unwrap();
        writeln!(stdin, "killed1").unwrap();
        println!("ready");
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let dir = temp_dir("killed");
    let (path, log) = fake_docker(&dir);
    let mut process = child(
        "the_reaper_removes_the_ids_of_a_process_that_was_killed",
        &[("FAKE_PATH", &path)],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(process.stdout.take().unwrap()).lines();
    // libtest may print "test NAME ... " before it on the same line.
    assert!(lines.any(|line| line.unwrap().ends_with("ready")));
    process.kill().unwrap();
    process.wait().unwrap();
    assert_eq!(logged(&log), "rm --force --volumes killed1\n");
}
