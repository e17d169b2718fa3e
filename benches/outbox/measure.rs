//! Measuring: CPU seconds per process, resident memory, percentiles.

use serde_json::json;

use crate::round;

/// CPU seconds used so far by the brokers (RabbitMQ and nats-server), the database server and this process (and one
/// more process, if given), to show what limits a figure.
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
                "postgres" => by_name[1] += ticks(&pid),
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
