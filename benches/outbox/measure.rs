//! Measuring: CPU seconds per process, resident memory, percentiles.

use serde_json::json;

use crate::round;

/// The PostgreSQL backend of the benchmark's own connection, which fills tables and polls
/// for progress: left out of the PostgreSQL figure, which is the work of what is measured.
static WATCHER_BACKEND: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Leaves the backend `pid` out of every later PostgreSQL reading.
pub(crate) fn leave_out_backend(pid: u32) {
    WATCHER_BACKEND.store(pid, std::sync::atomic::Ordering::SeqCst);
}

/// CPU seconds used so far by the brokers (RabbitMQ and nats-server), the database server
/// (but for the backend left out by [`leave_out_backend`]) and this process (and one more
/// process, if given), to show what limits a figure.
pub(crate) fn cpu_seconds(extra: Option<u32>) -> [f64; 4] {
    let ticks = |pid: &str| -> f64 {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let after = s.rsplit_once(')')?.1;
                let f: Vec<&str> = after.split_whitespace().collect();
                Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
            })
            .unwrap_or(0.0)
            / 100.0
    };
    let watcher = WATCHER_BACKEND.load(std::sync::atomic::Ordering::SeqCst);
    let mut by_name = [0.0; 2];
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let pid = entry.file_name().to_string_lossy().into_owned();
            if !pid.chars().all(|c| c.is_ascii_digit()) {
                continue;
            }
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            match comm.trim() {
                "beam.smp" | "nats-server" => by_name[0] += ticks(&pid),
                "postgres" if pid.parse() != Ok(watcher) => by_name[1] += ticks(&pid),
                _ => {}
            }
        }
    }
    [
        by_name[0],
        by_name[1],
        ticks("self"),
        extra.map_or(0.0, |p| ticks(&p.to_string())),
    ]
}

/// Indexes into [`cpu_seconds`]: the brokers, PostgreSQL, the benchmark process, the extra
/// process.
pub(crate) const BROKER: usize = 0;
pub(crate) const POSTGRES: usize = 1;
pub(crate) const CLIENT: usize = 2;
pub(crate) const EXTRA: usize = 3;

/// CPU microseconds per item of each process between two readings of [`cpu_seconds`].
pub(crate) fn micros_per(before: [f64; 4], after: [f64; 4], items: usize) -> [f64; 4] {
    std::array::from_fn(|i| (after[i] - before[i]) * 1e6 / items.max(1) as f64)
}

/// A timed window over which each process's CPU is read: started with [`Cpu::start`], read
/// with [`Cpu::per`].
pub(crate) struct Cpu {
    before: [f64; 4],
    extra: Option<u32>,
    started: std::time::Instant,
}

impl Cpu {
    /// Starts the window now; `extra` is the relay's process, when it runs as one.
    pub(crate) fn start(extra: Option<u32>) -> Cpu {
        Cpu {
            before: cpu_seconds(extra),
            extra,
            started: std::time::Instant::now(),
        }
    }

    /// The cores each process used since the start and its CPU microseconds per item, as
    /// JSON for a figure's parameters (`bench` is this process, with any relay or consumer
    /// that runs inside it; `relay` the relay's own process).
    pub(crate) fn per(&self, items: usize) -> serde_json::Value {
        let after = cpu_seconds(self.extra);
        let wall = self.started.elapsed().as_secs_f64();
        let us = micros_per(self.before, after, items);
        let mut v = cpu_share(self.before, after, wall);
        for (i, name) in [
            (BROKER, "broker_us"),
            (POSTGRES, "postgres_us"),
            (CLIENT, "bench_us"),
            (EXTRA, "relay_us"),
        ] {
            v[name] = json!(round(us[i]));
        }
        v
    }
}

pub(crate) fn cpu_share(before: [f64; 4], after: [f64; 4], wall: f64) -> serde_json::Value {
    let share = |i: usize| round((after[i] - before[i]) / wall);
    json!({ "broker_cores": share(0), "postgres_cores": share(1), "bench_cores": share(2), "relay_cores": share(3) })
}

/// A field of `/proc/<pid>/status`, in KiB.
pub(crate) fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub(crate) fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * (values.len() - 1) as f64).round() as usize;
    values[idx]
}

pub(crate) fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}
