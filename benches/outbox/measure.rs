//! Measuring: CPU seconds per process, resident memory, percentiles.

use serde_json::json;

use crate::round;

/// CPU seconds used so far by the brokers (RabbitMQ, nats-server and Tansu), the database server
/// (but for the backend `leave_out`) and this process (and one more process, if given), in
/// the order of [`BROKER`], [`POSTGRES`], [`CLIENT`], [`EXTRA`].
fn cpu_seconds(extra: Option<u32>, leave_out: u32) -> [f64; 4] {
    let ticks = |pid: &str| process_seconds(pid);
    let mut by_name = [0.0; 2];
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let pid = entry.file_name().to_string_lossy().into_owned();
            if !pid.chars().all(|c| c.is_ascii_digit()) {
                continue;
            }
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            match comm.trim() {
                // Tansu's binary is `tansu-v<version>-<commit>`.
                "beam.smp" | "nats-server" => by_name[0] += ticks(&pid),
                name if name.starts_with("tansu") => by_name[0] += ticks(&pid),
                "postgres" if pid.parse() != Ok(leave_out) => by_name[1] += ticks(&pid),
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

/// CPU seconds (user and system) process `pid` (or `self`) has used so far; 0 for one that
/// is gone.
pub(crate) fn process_seconds(pid: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1;
            let f: Vec<&str> = after.split_whitespace().collect();
            Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
        })
        .unwrap_or(0.0)
        / 100.0
}

/// Indexes into [`CpuUse`]: the brokers, PostgreSQL, the benchmark process (with any relay
/// or consumer running inside it), the relay's own process.
pub(crate) const BROKER: usize = 0;
pub(crate) const POSTGRES: usize = 1;
pub(crate) const CLIENT: usize = 2;
pub(crate) const EXTRA: usize = 3;

/// A timed window over which each process's CPU is read (`Env::cpu` starts one).
pub(crate) struct Cpu {
    before: [f64; 4],
    extra: Option<u32>,
    leave_out: u32,
    started: std::time::Instant,
}

/// What each process used over a [`Cpu`] window.
pub(crate) struct CpuUse {
    /// CPU microseconds per item.
    pub(crate) us: [f64; 4],
    /// Cores in use on average.
    cores: [f64; 4],
}

impl Cpu {
    /// Starts the window now; `extra` is the relay's process, when it runs as one, and the
    /// PostgreSQL backend `leave_out` is not counted.
    pub(crate) fn start(extra: Option<u32>, leave_out: u32) -> Cpu {
        Cpu {
            before: cpu_seconds(extra, leave_out),
            extra,
            leave_out,
            started: std::time::Instant::now(),
        }
    }

    /// What each process used from the start until now, per item of `items`.
    pub(crate) fn used(&self, items: usize) -> CpuUse {
        let after = cpu_seconds(self.extra, self.leave_out);
        let wall = self.started.elapsed().as_secs_f64();
        CpuUse {
            us: std::array::from_fn(|i| (after[i] - self.before[i]) * 1e6 / items.max(1) as f64),
            cores: std::array::from_fn(|i| (after[i] - self.before[i]) / wall),
        }
    }
}

impl CpuUse {
    /// CPU microseconds per item, every process together.
    pub(crate) fn total_us(&self) -> f64 {
        self.us.iter().sum()
    }

    /// Cores in use on average, every process together.
    pub(crate) fn total_cores(&self) -> f64 {
        self.cores.iter().sum()
    }

    /// As JSON for a figure's parameters.
    pub(crate) fn json(&self) -> serde_json::Value {
        let mut v = json!({});
        for (i, name) in [
            (BROKER, "broker"),
            (POSTGRES, "postgres"),
            (CLIENT, "bench"),
            (EXTRA, "relay"),
        ] {
            v[format!("{name}_cores")] = json!(round(self.cores[i]));
            v[format!("{name}_us")] = json!(round(self.us[i]));
        }
        v
    }
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
