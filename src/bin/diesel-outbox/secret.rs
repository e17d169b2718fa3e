//! Redaction of URLs, credentials and their passwords, in one place.
//!
//! Every URL- or credential-valued argument has the type [`Secret`], whether it comes from
//! the command line, the environment or a file (`--NAME-file`, or the `NAME_FILE`
//! environment variable of container secrets, read by [`read_file`] as the arguments are
//! parsed); [`Secrets::of`] collects every value of that type among the parsed arguments,
//! so an argument added later is redacted without being listed anywhere. Every error
//! message goes through [`Secrets::redact`] before it is printed.

use std::convert::Infallible;
use std::fmt;
use std::str::FromStr;

use clap::ArgMatches;

/// A URL that may hold a password, or a credential: shown as `***` by `Debug` and
/// `Display`; the text itself only through [`Secret::expose`], where a connection is made.
#[derive(Clone)]
pub(crate) struct Secret(String);

/// The secret given as `value` (`--NAME` or `NAME`) or as `file` (`--NAME-file` or
/// `NAME_FILE`): a command-line flag wins over the environment, and two of the same kind
/// are a usage error (naming the arguments, never their values).
pub(crate) fn pick(
    matches: &ArgMatches,
    value: (&str, Option<Secret>),
    file: (&str, Option<Secret>),
) -> Result<Option<Secret>, String> {
    use clap::parser::ValueSource;
    let source = |id: &str| matches.value_source(id);
    match (value.1, file.1) {
        (Some(v), Some(f)) => match (source(value.0), source(file.0)) {
            (Some(ValueSource::CommandLine), Some(ValueSource::EnvVariable)) => Ok(Some(v)),
            (Some(ValueSource::EnvVariable), Some(ValueSource::CommandLine)) => Ok(Some(f)),
            _ => Err(format!(
                "give --{} or --{}, not both",
                value.0.replace('_', "-"),
                file.0.replace('_', "-")
            )),
        },
        (v, f) => Ok(v.or(f)),
    }
}

/// Reads a secret from the file at `path` (its content less trailing whitespace, such as
/// the newline of a container secret), as the arguments are parsed. An error names the
/// file, never its content.
pub(crate) fn read_file(path: &str) -> Result<Secret, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let text = text.trim_end();
    if text.is_empty() {
        return Err(format!("{path} is empty"));
    }
    Ok(Secret(text.to_owned()))
}

impl Secret {
    /// The URL or credential, for connecting.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// The values of `KEY=VALUE` lines (Kafka properties) worth scrubbing: those of keys
    /// that name a secret whatever their length, and others of four characters or more
    /// (shorter ones, `all` or `5`, would mangle every message they appear in).
    fn property_values(&self) -> impl Iterator<Item = &str> {
        self.0.lines().filter_map(|line| {
            let (key, value) = line.split_once('=')?;
            let key = key.trim();
            let value = value.trim();
            let secret = diesel_outbox::kafka::is_secret_property(key);
            (secret || value.chars().count() >= 4).then_some(value)
        })
    }

    /// The password in the URL's user info, if any.
    fn password(&self) -> Option<&str> {
        let rest = self.0.split_once("://")?.1;
        let userinfo = rest.split('/').next()?.rsplit_once('@')?.0;
        Some(userinfo.split_once(':')?.1)
    }
}

impl FromStr for Secret {
    type Err = Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The texts to scrub from messages: every [`Secret`] argument and its password.
#[derive(Debug, Default)]
pub(crate) struct Secrets(Vec<String>);

impl Secrets {
    /// Every [`Secret`] among `matches` and its subcommands' matches (each value of one
    /// given several times), and the values of the Kafka properties.
    pub(crate) fn of(matches: &ArgMatches) -> Self {
        let mut urls = Vec::new();
        let mut texts = Vec::new();
        collect(matches, &mut urls, &mut texts);
        for url in urls {
            texts.extend(url.password().map(str::to_owned));
            texts.push(url.0);
        }
        texts.retain(|s| !s.is_empty());
        // Longest first, so a URL is replaced whole before its password.
        texts.sort_by_key(|s| std::cmp::Reverse(s.len()));
        texts.dedup();
        Secrets(texts)
    }

    /// `message` with every secret replaced by `***`.
    pub(crate) fn redact(&self, message: &str) -> String {
        self.0
            .iter()
            .fold(message.to_owned(), |m, s| m.replace(s.as_str(), "***"))
    }
}

/// The arguments whose values are `KEY=VALUE` lines.
const PROPERTIES: [&str; 2] = ["kafka_property", "kafka_properties_file"];

fn collect(matches: &ArgMatches, urls: &mut Vec<Secret>, values: &mut Vec<String>) {
    for id in matches.ids() {
        if let Ok(Some(found)) = matches.try_get_many::<Secret>(id.as_str()) {
            for secret in found {
                if PROPERTIES.contains(&id.as_str()) {
                    values.extend(secret.property_values().map(str::to_owned));
                }
                urls.push(secret.clone());
            }
        }
    }
    if let Some((_, sub)) = matches.subcommand() {
        collect(sub, urls, values);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    #[test]
    fn every_url_argument_is_redacted_with_its_password() {
        let matches = crate::Cli::command()
            .try_get_matches_from([
                "diesel-outbox",
                "--database-url",
                "postgres://app:db-pass@db.internal/app",
                "relay",
                "--exchange",
                "events",
                "--amqp-url",
                "amqp://relay:mq-pass@mq.internal/%2f",
                "--nats-url",
                "nats://relay:nats-pass@nats.internal:4222",
            ])
            .unwrap();
        let secrets = Secrets::of(&matches);
        let message = "cannot reach postgres://app:db-pass@db.internal/app; login failed \
                       for relay:mq-pass (amqp://relay:mq-pass@mq.internal/%2f); db-pass; \
                       nats://relay:nats-pass@nats.internal:4222 nats-pass";
        let redacted = secrets.redact(message);
        for secret in [
            "db-pass",
            "mq-pass",
            "nats-pass",
            "db.internal",
            "mq.internal",
            "nats.internal",
        ] {
            assert!(!redacted.contains(secret), "{redacted}");
        }
        let cli = crate::Cli::from_arg_matches(&matches).unwrap();
        assert_eq!(format!("{:?}", cli.database_url), "Some(Secret(***))");
    }

    #[test]
    fn kafka_property_values_are_redacted() {
        let matches = crate::Cli::command()
            .try_get_matches_from([
                "diesel-outbox",
                "declare",
                "--broker",
                "kafka",
                "--topic",
                "t",
                "--kafka-property",
                "sasl.password=pw",
                "--kafka-property",
                "sasl.oauthbearer.client.secret = s3cret-two",
                "--kafka-property",
                "linger.ms=5",
            ])
            .unwrap();
        let redacted = Secrets::of(&matches).redact("pw s3cret-two at 127.0.0.1:5432");
        assert_eq!(redacted, "*** *** at 127.0.0.1:5432");
    }

    #[test]
    fn a_url_without_a_password_is_still_redacted_whole() {
        let url: Secret = "postgres://db.internal/app".parse().unwrap();
        assert_eq!(url.password(), None);
        assert_eq!(url.to_string(), "***");
    }

    #[test]
    fn secrets_read_from_files_are_redacted_too() {
        let dir = std::env::temp_dir().join(format!("outbox-secret-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let url_file = dir.join("database-url");
        std::fs::write(&url_file, "postgres://app:file-pass@db.internal/app\n").unwrap();
        let token_file = dir.join("token");
        std::fs::write(&token_file, "file-token\n").unwrap();
        let matches = crate::Cli::command()
            .try_get_matches_from([
                "diesel-outbox",
                "--database-url-file",
                url_file.to_str().unwrap(),
                "relay",
                "--broker",
                "nats",
                "--nats-url",
                "nats://127.0.0.1:4222",
                "--nats-token-file",
                token_file.to_str().unwrap(),
            ])
            .unwrap();
        let secrets = Secrets::of(&matches);
        let redacted =
            secrets.redact("postgres://app:file-pass@db.internal/app file-pass file-token");
        for secret in ["file-pass", "db.internal", "file-token"] {
            assert!(!redacted.contains(secret), "{redacted}");
        }
        let cli = crate::Cli::from_arg_matches(&matches).unwrap();
        assert_eq!(
            cli.database_url_file.as_ref().map(Secret::expose),
            Some("postgres://app:file-pass@db.internal/app"),
            "read without its trailing newline"
        );
        assert_eq!(format!("{:?}", cli.database_url_file), "Some(Secret(***))");
        let missing = crate::Cli::command()
            .try_get_matches_from([
                "diesel-outbox",
                "--database-url-file",
                "/nonexistent/url",
                "stats",
            ])
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("cannot read /nonexistent/url"),
            "{missing}"
        );
        let both = crate::Cli::command()
            .try_get_matches_from([
                "diesel-outbox",
                "--database-url",
                "postgres://x",
                "--database-url-file",
                url_file.to_str().unwrap(),
                "stats",
            ])
            .unwrap();
        let both = crate::Cli::from_arg_matches(&both)
            .unwrap()
            .resolve(&both)
            .err()
            .unwrap();
        assert_eq!(both, "give --database-url or --database-url-file, not both");
        let _ = std::fs::remove_dir_all(dir);
    }
}
