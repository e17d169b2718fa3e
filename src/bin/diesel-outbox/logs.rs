//! The binary's logs: `RUST_LOG` (or `info`) with the dependencies that would print
//! payloads or credentials capped, as text or as one JSON object per line
//! (`--log-format json`), on stderr.

use clap::ValueEnum;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, with tracing's fields.
    Json,
}

/// Installs the process's subscriber; without `RUST_LOG`, at `default` level.
pub(crate) fn init(format: LogFormat, default: &str) {
    let filter = log_filter(std::env::var("RUST_LOG").ok().as_deref(), default);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Targets of dependencies that log payloads or credentials, or repeat what the crate
/// reports, and the most they may log. lapin logs returned messages (payload included)
/// at warn and every frame (the login's password included) at trace; async-nats logs its
/// handshake (credentials included) at trace; both log each connection failure at error,
/// which the crate returns or logs itself, naming the broker (so they are off unless
/// `RUST_LOG` names them). amq-protocol logs the broker URL at trace; tokio-postgres logs
/// bound parameters (payloads) at debug.
const QUIET: &[(&str, &str)] = &[
    ("lapin", "off"),
    ("async_nats", "off"),
    ("amq_protocol", "info"),
    ("tokio_postgres", "info"),
];

/// `RUST_LOG` (or `default`), with [`QUIET`]'s directives added for every target it does
/// not name itself.
fn log_filter(rust_log: Option<&str>, default: &str) -> tracing_subscriber::EnvFilter {
    let spec = rust_log.filter(|s| !s.trim().is_empty()).unwrap_or(default);
    const LEVELS: &[&str] = &["trace", "debug", "info", "warn", "error", "off"];
    // A directive names a target when it is `target`, `target=level` or `target[span]=..`.
    let named = |target: &str| {
        spec.split(',').any(|directive| {
            let directive = directive.trim();
            let name = match directive.split_once('=') {
                Some((name, _)) => name,
                None if LEVELS.contains(&directive.to_ascii_lowercase().as_str()) => return false,
                None => directive,
            };
            let name = name.split('[').next().unwrap_or_default().trim();
            !name.is_empty() && (name.starts_with(target) || target.starts_with(name))
        })
    };
    // A quiet target's level is a cap: it is added only where the general level would let
    // more through (never to make a target louder than `RUST_LOG` asked).
    let general = spec
        .split(',')
        .map(|d| d.trim().to_ascii_lowercase())
        .rfind(|d| LEVELS.contains(&d.as_str()))
        .map_or(LEVELS.len() - 1, |d| verbosity(&d));
    let mut directives = vec![spec.to_owned()];
    for (target, level) in QUIET {
        if !named(target) && verbosity(level) > general {
            directives.push(format!("{target}={level}"));
        }
    }
    tracing_subscriber::EnvFilter::try_new(directives.join(",")).unwrap_or_else(|_| {
        let mut fallback = vec!["info".to_owned()];
        fallback.extend(QUIET.iter().map(|(t, l)| format!("{t}={l}")));
        tracing_subscriber::EnvFilter::new(fallback.join(","))
    })
}

/// How much a level lets through: 0 for `trace`, up to 5 for `off`.
fn verbosity(level: &str) -> usize {
    ["trace", "debug", "info", "warn", "error", "off"]
        .iter()
        .position(|l| *l == level)
        .unwrap_or(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(rust_log: Option<&str>) -> String {
        log_filter(rust_log, "info").to_string()
    }

    #[test]
    fn the_quiet_targets_are_added_unless_named() {
        for spec in [Some("trace"), Some("info,diesel_outbox=trace,trace")] {
            let filter = shown(spec);
            for (target, level) in QUIET {
                assert!(
                    filter.contains(&format!("{target}={level}")),
                    "{spec:?}: {filter}"
                );
            }
        }
        // At info (the default) only the targets capped below info get a directive.
        for spec in [None, Some(""), Some("info")] {
            let filter = shown(spec);
            assert!(filter.contains("lapin=off"), "{spec:?}: {filter}");
            assert!(filter.contains("async_nats=off"), "{spec:?}: {filter}");
        }
        // A cap never makes a target louder than asked.
        let quiet = shown(Some("warn"));
        assert!(quiet.contains("async_nats=off"), "{quiet}");
        assert!(!quiet.contains("tokio_postgres=info"), "{quiet}");
        assert!(quiet.contains("lapin=off"), "{quiet}");
        let targets_only = shown(Some("diesel_outbox=trace"));
        assert!(!targets_only.contains("async_nats"), "{targets_only}");
        let named = shown(Some("trace,lapin=debug"));
        assert!(
            named.contains("lapin=debug") && !named.contains("lapin=off"),
            "{named}"
        );
        assert!(named.contains("tokio_postgres=info"), "{named}");
    }
}
