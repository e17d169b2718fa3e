//! PostgreSQL servers of a test's own, apart from the shared one: made with `initdb` (or
//! `pg_basebackup -R` from another) in a scratch directory, on free loopback ports, run as
//! the `postgres` user (PostgreSQL refuses to run as root). Dropping a node stops it;
//! dropping the scratch directory's last handle removes it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A scratch directory owned by `postgres`, and the server's programs.
pub struct Scratch {
    pub dir: PathBuf,
    bin: PathBuf,
}

impl Scratch {
    pub fn new(prefix: &str) -> Arc<Scratch> {
        let bin = server_bin();
        let dir = std::env::temp_dir().join(super::unique(prefix));
        std::fs::create_dir_all(&dir).unwrap();
        chown_to_postgres(&dir);
        Arc::new(Scratch { dir, bin })
    }

    /// Writes `contents` to `name` in the directory, readable by `postgres` only (as the
    /// server wants its private key).
    pub fn private_file(&self, name: &str, contents: &[u8]) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.join(name);
        std::fs::write(&path, contents).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        chown_to_postgres(&path);
        path
    }

    /// Runs one of the server's programs as `postgres`; panics with its stderr if it fails.
    pub fn run(&self, program: &str, args: &[&str]) {
        let output = as_postgres(&self.bin.join(program))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        assert!(
            output.status.success(),
            "{program} {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One running server.
pub struct Node {
    pub port: u16,
    data: PathBuf,
    scratch: Arc<Scratch>,
}

impl Node {
    /// A new cluster (trust authentication unless `hba` says otherwise) on `port`, with
    /// `conf` added to its configuration, started.
    pub fn init(scratch: &Arc<Scratch>, port: u16, conf: &str, hba: Option<&str>) -> Node {
        let node = Node::at(scratch, port);
        scratch.run(
            "initdb",
            &[
                "-D",
                path(&node.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        node.write_conf(&format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\n\
             fsync = off\nmax_connections = 200\n{conf}\n",
            scratch.dir.display()
        ));
        if let Some(hba) = hba {
            std::fs::write(node.data.join("pg_hba.conf"), hba).unwrap();
        }
        node.pg_ctl(&["start"]);
        node
    }

    /// A streaming replica of `primary` (`pg_basebackup -R`) on `port`, started; any old
    /// data at its place is removed first.
    pub fn replica_of(scratch: &Arc<Scratch>, port: u16, primary: &Node) -> Node {
        let node = Node::at(scratch, port);
        let _ = std::fs::remove_dir_all(&node.data);
        scratch.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
                "-D",
                path(&node.data),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        );
        node.write_conf(&format!("port = {port}\ncluster_name = 'replica'\n"));
        node.pg_ctl(&["start"]);
        node
    }

    fn at(scratch: &Arc<Scratch>, port: u16) -> Node {
        Node {
            port,
            data: scratch.dir.join(format!("node-{port}")),
            scratch: scratch.clone(),
        }
    }

    /// Appends to `postgresql.auto.conf` (later lines win).
    fn write_conf(&self, lines: &str) {
        let conf = self.data.join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap_or_default();
        text.push_str(lines);
        std::fs::write(&conf, text).unwrap();
    }

    /// `pg_ctl` on this node, waiting for it to finish.
    pub fn pg_ctl(&self, args: &[&str]) {
        let log = self.scratch.dir.join(format!("node-{}.log", self.port));
        let mut all = vec!["-D", path(&self.data), "-l", path(&log), "-w"];
        all.extend_from_slice(args);
        self.scratch.run("pg_ctl", &all);
    }

    /// Runs `sql` as `postgres`; returns what it printed, trimmed.
    pub fn psql(&self, sql: &str) -> String {
        let output = Command::new(self.scratch.bin.join("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-d", "postgres", "-AtX", "-c", sql])
            .env("PGSSLMODE", "disable")
            .output()
            .expect("psql");
        assert!(
            output.status.success(),
            "psql {sql:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Waits until `sql` prints `expected`, for at most a minute.
    pub fn wait_for(&self, sql: &str, expected: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.psql(sql) != expected {
            assert!(
                Instant::now() < deadline,
                "{sql:?} never printed {expected:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether the server is running.
    pub fn running(&self) -> bool {
        self.data.join("postmaster.pid").exists()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.running() {
            let _ = as_postgres(&self.scratch.bin.join("pg_ctl"))
                .args(["-D", path(&self.data), "-m", "immediate", "-w", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Loopback ports free right now.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: [std::net::TcpListener; N] =
        std::array::from_fn(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    listeners.map(|l| l.local_addr().unwrap().port())
}

/// What this machine lacks to run PostgreSQL servers of a test's own, if anything.
pub fn missing() -> Option<String> {
    newest_bin().is_none().then(|| {
        "PostgreSQL's server programs (initdb, pg_ctl, pg_basebackup) are not under \
         /usr/lib/postgresql/<version>/bin: apt-get install -y postgresql"
            .to_owned()
    })
}

fn newest_bin() -> Option<PathBuf> {
    let root = Path::new("/usr/lib/postgresql");
    let newest = std::fs::read_dir(root)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .max()?;
    let bin = root.join(newest.to_string()).join("bin");
    bin.join("pg_basebackup").exists().then_some(bin)
}

/// The newest installed PostgreSQL server's programs (Debian keeps them out of `PATH`).
fn server_bin() -> PathBuf {
    newest_bin().unwrap_or_else(|| panic!("{}", missing().unwrap_or_default()))
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

fn chown_to_postgres(path: &Path) {
    if running_as_root() {
        let status = Command::new("chown")
            .arg("postgres:")
            .arg(path)
            .status()
            .unwrap();
        assert!(status.success(), "chown {} to postgres", path.display());
    }
}

/// PostgreSQL's programs refuse to run as root: then they run as `postgres`.
fn as_postgres(program: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}
