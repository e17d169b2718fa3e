//! Redaction of URLs and their passwords, in one place.
//!
//! Every URL-valued argument has the type [`SecretUrl`], and [`Secrets::of`] collects every
//! value of that type among the parsed arguments: an argument added later is redacted
//! without being listed anywhere. Every error message goes through [`Secrets::redact`]
//! before it is printed.

use std::convert::Infallible;
use std::fmt;
use std::str::FromStr;

use clap::ArgMatches;

/// A URL that may hold a password: shown as `***` by `Debug` and `Display`; the text
/// itself only through [`SecretUrl::expose`], where a connection is made.
#[derive(Clone)]
pub(crate) struct SecretUrl(String);

impl SecretUrl {
    /// The URL, for connecting.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// The password in the URL's user info, if any.
    fn password(&self) -> Option<&str> {
        let rest = self.0.split_once("://")?.1;
        let userinfo = rest.split('/').next()?.rsplit_once('@')?.0;
        Some(userinfo.split_once(':')?.1)
    }
}

impl FromStr for SecretUrl {
    type Err = Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(SecretUrl(s.to_owned()))
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretUrl(***)")
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The texts to scrub from messages: every [`SecretUrl`] argument and its password.
#[derive(Debug, Default)]
pub(crate) struct Secrets(Vec<String>);

impl Secrets {
    /// Every [`SecretUrl`] among `matches` and its subcommands' matches.
    pub(crate) fn of(matches: &ArgMatches) -> Self {
        let mut urls = Vec::new();
        collect(matches, &mut urls);
        let mut texts = Vec::new();
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

fn collect(matches: &ArgMatches, urls: &mut Vec<SecretUrl>) {
    for id in matches.ids() {
        if let Ok(Some(url)) = matches.try_get_one::<SecretUrl>(id.as_str()) {
            urls.push(url.clone());
        }
    }
    if let Some((_, sub)) = matches.subcommand() {
        collect(sub, urls);
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
        assert_eq!(format!("{:?}", cli.database_url), "Some(SecretUrl(***))");
    }

    #[test]
    fn a_url_without_a_password_is_still_redacted_whole() {
        let url: SecretUrl = "postgres://db.internal/app".parse().unwrap();
        assert_eq!(url.password(), None);
        assert_eq!(url.to_string(), "***");
    }
}
