//! The link to Kafka: TLS and SASL as librdkafka settings, shared by the publisher, the
//! consumer source and the topology helper, and a client context that keeps the last
//! connection error librdkafka reported, so that a failed connect says why.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use base64::Engine as _;
use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::tls::Tls;

/// How a Kafka client logs in with SASL: PLAIN or SCRAM (SHA-256 or SHA-512) with a user
/// and password, as managed clusters (Confluent Cloud, Amazon MSK, Aiven, Redpanda) issue
/// them. Its `Debug` never shows the password.
///
/// Hazard: without [`Tls`] the login goes over plain TCP (`SASL_PLAINTEXT`); PLAIN then
/// sends the password in the clear. Give a [`Tls`] too unless the network is trusted.
///
/// ```
/// use diesel_outbox::kafka::Sasl;
///
/// let password = std::env::var("KAFKA_PASSWORD").unwrap_or_default();
/// let sasl = Sasl::scram_sha512("relay", password);
/// # let _ = sasl;
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Sasl {
    mechanism: Mechanism,
    user: String,
    password: String,
}

/// A SASL mechanism, as librdkafka names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mechanism {
    Plain,
    ScramSha256,
    ScramSha512,
}

impl Mechanism {
    fn name(self) -> &'static str {
        match self {
            Mechanism::Plain => "PLAIN",
            Mechanism::ScramSha256 => "SCRAM-SHA-256",
            Mechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

impl Sasl {
    /// `PLAIN`: the user and password as they are (use it with [`Tls`]).
    pub fn plain(user: impl Into<String>, password: impl Into<String>) -> Self {
        Sasl::new(Mechanism::Plain, user, password)
    }

    /// `SCRAM-SHA-256`: a challenge and response; the password never crosses the wire.
    pub fn scram_sha256(user: impl Into<String>, password: impl Into<String>) -> Self {
        Sasl::new(Mechanism::ScramSha256, user, password)
    }

    /// `SCRAM-SHA-512`: as [`Sasl::scram_sha256`] with SHA-512.
    pub fn scram_sha512(user: impl Into<String>, password: impl Into<String>) -> Self {
        Sasl::new(Mechanism::ScramSha512, user, password)
    }

    fn new(mechanism: Mechanism, user: impl Into<String>, password: impl Into<String>) -> Self {
        Sasl {
            mechanism,
            user: user.into(),
            password: password.into(),
        }
    }
}

impl fmt::Debug for Sasl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sasl({}, {:?}, ***)", self.mechanism.name(), self.user)
    }
}

/// What a Kafka client connects with besides the brokers: TLS, a SASL login, both or
/// neither.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Security {
    pub(crate) tls: Option<Tls>,
    pub(crate) sasl: Option<Sasl>,
}

impl Security {
    /// Sets librdkafka's `security.protocol` and what goes with it. The files of the TLS
    /// settings are read (and checked) here: an error names the file and the cause.
    pub(crate) fn apply(&self, config: &mut ClientConfig) -> Result<(), String> {
        let protocol = match (&self.tls, &self.sasl) {
            (None, None) => "plaintext",
            (Some(_), None) => "ssl",
            (None, Some(_)) => "sasl_plaintext",
            (Some(_), Some(_)) => "sasl_ssl",
        };
        config.set("security.protocol", protocol);
        if let Some(tls) = &self.tls {
            let loaded = tls.load()?;
            // librdkafka trusts either its own default roots or what it is given: the
            // platform's roots go along with a CA file, so that it adds to them.
            if let Some(ca) = &loaded.ca {
                config.set("ssl.ca.pem", roots_pem(&ca.text));
            }
            if let Some(client) = &loaded.client {
                config.set("ssl.certificate.pem", &client.chain.text);
                config.set("ssl.key.pem", &client.key.text);
            }
        }
        // The broker's name is checked against its certificate (librdkafka's default,
        // said here so that it cannot drift), also over a TLS that a `security.protocol`
        // property asks for.
        config.set("ssl.endpoint.identification.algorithm", "https");
        if let Some(sasl) = &self.sasl {
            if sasl.user.is_empty() {
                return Err("the Kafka SASL user is empty".into());
            }
            config
                .set("sasl.mechanism", sasl.mechanism.name())
                .set("sasl.username", &sasl.user)
                .set("sasl.password", &sasl.password);
        }
        Ok(())
    }
}

/// The platform's trusted roots and then `extra` (PEM text), as one PEM bundle.
fn roots_pem(extra: &str) -> String {
    let mut pem = String::new();
    for cert in rustls_native_certs::load_native_certs().certs {
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        let encoded = base64::engine::general_purpose::STANDARD.encode(cert.as_ref());
        for line in encoded.as_bytes().chunks(64) {
            pem.push_str(std::str::from_utf8(line).unwrap_or_default());
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    pem.push_str(extra);
    pem
}

/// A client context that keeps the last error librdkafka reported about its connections
/// ("SSL handshake failed: … certificate verify failed", "SASL authentication error: …"),
/// which its own API errors ("broker transport failure") leave out. librdkafka's messages
/// name brokers and causes, never a password.
#[derive(Clone, Default)]
pub(crate) struct Observed {
    last_error: Arc<Mutex<Option<String>>>,
}

impl Observed {
    /// The last connection error reported, if any.
    pub(crate) fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// `error`, with the last connection error librdkafka reported after it when there is
    /// one.
    pub(crate) fn explain(&self, error: impl fmt::Display) -> String {
        match self.last_error() {
            Some(reason) => format!("{error} ({reason})"),
            None => error.to_string(),
        }
    }
}

impl ClientContext for Observed {
    /// librdkafka logs each failed connection attempt as an error, again and again while a
    /// broker is out of reach; the crate reports the outage itself (with the cause kept by
    /// [`Observed::error`]), so librdkafka's own lines go to `debug` under the target
    /// `librdkafka`, but for its emergencies.
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        if matches!(
            level,
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical
        ) {
            tracing::warn!(target: "librdkafka", facility, "{message}");
        } else {
            tracing::debug!(target: "librdkafka", facility, "{message}");
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(error = %error, reason, "librdkafka reported an error");
        let mut last = self
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // "1/1 brokers are down" follows each failed connection: the cause said before it
        // is what is worth keeping.
        let all_down = error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown);
        if !all_down || last.is_none() {
            *last = Some(reason.to_owned());
        }
    }
}

/// For a consumer that only reads metadata (the source's look at its topics).
impl rdkafka::consumer::ConsumerContext for Observed {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_login_never_shows_its_password() {
        let sasl = Sasl::scram_sha256("relay", "s3cret");
        let shown = format!(
            "{sasl:?} {:?}",
            Security {
                tls: None,
                sasl: Some(sasl.clone()),
            }
        );
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("SCRAM-SHA-256") && shown.contains("relay"),
            "{shown}"
        );
    }

    #[test]
    fn the_protocol_follows_what_is_given() {
        let protocol = |security: Security| {
            let mut config = ClientConfig::new();
            security.apply(&mut config).unwrap();
            (
                config.get("security.protocol").unwrap().to_owned(),
                config.get("sasl.mechanism").map(str::to_owned),
            )
        };
        assert_eq!(protocol(Security::default()).0, "plaintext");
        let sasl = Some(Sasl::plain("u", "p"));
        assert_eq!(
            protocol(Security {
                tls: None,
                sasl: sasl.clone()
            }),
            ("sasl_plaintext".into(), Some("PLAIN".into()))
        );
        assert_eq!(
            protocol(Security {
                tls: Some(Tls::new()),
                sasl: Some(Sasl::scram_sha512("u", "p")),
            }),
            ("sasl_ssl".into(), Some("SCRAM-SHA-512".into()))
        );
        assert_eq!(
            protocol(Security {
                tls: Some(Tls::new()),
                sasl: None
            })
            .0,
            "ssl"
        );
    }

    #[test]
    fn bad_settings_name_their_cause() {
        let mut config = ClientConfig::new();
        let err = Security {
            tls: None,
            sasl: Some(Sasl::plain("", "p")),
        }
        .apply(&mut config)
        .unwrap_err();
        assert!(err.contains("user is empty"), "{err}");
        let err = Security {
            tls: Some(Tls::new().ca_file("/nonexistent/ca.pem")),
            sasl: None,
        }
        .apply(&mut config)
        .unwrap_err();
        assert!(err.contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn a_ca_file_adds_to_the_platform_roots() {
        let pem = roots_pem("EXTRA");
        assert!(pem.ends_with("EXTRA"));
        let platform = rustls_native_certs::load_native_certs().certs.len();
        assert_eq!(pem.matches("-----BEGIN CERTIFICATE-----").count(), platform);
    }
}
