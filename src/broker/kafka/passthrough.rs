//! librdkafka properties passed through by `.property(key, value)`, the keys the crate owns
//! (refused, naming the key and why), and librdkafka's complaints about a configuration
//! told without the values given.

use std::fmt;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;

use super::Security;

/// The client a set of properties is for: each owns other keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Client {
    /// The publisher's idempotent producer.
    Producer,
    /// The consumer runner's source.
    Consumer,
    /// [`Topology`](super::Topology)'s clients.
    Admin,
}

/// librdkafka properties given with `.property`, in the order given (a key given twice: the
/// later value wins). `Debug` shows the keys, never the values, which may be secrets
/// (`sasl.password`, `sasl.oauthbearer.client.secret`).
#[derive(Clone, Default, PartialEq, Eq)]
pub(crate) struct Properties(Vec<(String, String)>);

impl fmt::Debug for Properties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(key, _)| (key, "***")))
            .finish()
    }
}

impl Properties {
    /// Adds `key` = `value`.
    pub(crate) fn push(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.0.push((key.into(), value.into()));
    }

    /// Why the crate refuses one of the keys for `client` (connected with `security`),
    /// naming the key, or `Ok` when it takes them all.
    pub(crate) fn check(&self, client: Client, security: &Security) -> Result<(), String> {
        for (key, value) in &self.0 {
            if key.trim().is_empty() {
                return Err("a Kafka property has an empty key".into());
            }
            if let Some(why) = owned(client, security, key, value) {
                return Err(format!(
                    "the Kafka property `{}` is the crate's own: {why}",
                    key.trim().escape_debug()
                ));
            }
        }
        Ok(())
    }

    /// Sets every property on `config`, over the crate's defaults (`client.id`,
    /// `linger.ms`); [`Properties::check`] first. A SASL mechanism given as a property
    /// over the crate's TLS logs in over TLS: `SSL` becomes `SASL_SSL`.
    pub(crate) fn apply(&self, config: &mut ClientConfig) {
        let given = |keys: &[&str]| self.0.iter().any(|(key, _)| keys.contains(&key.trim()));
        for (key, value) in &self.0 {
            let key = key.trim();
            // librdkafka takes an alias and its property as one: the crate's default goes.
            if key == "queue.buffering.max.ms" {
                config.remove("linger.ms");
            }
            config.set(key, value);
        }
        if given(&["sasl.mechanism", "sasl.mechanisms"])
            && !given(&["security.protocol"])
            && config.get("security.protocol") == Some("ssl")
        {
            config.set("security.protocol", "sasl_ssl");
        }
    }
}

/// The keys every client owns.
fn owned_by_all(security: &Security, key: &str) -> Option<&'static str> {
    Some(match key {
        "bootstrap.servers" | "metadata.broker.list" => {
            "the brokers are the `brokers` argument (--kafka-brokers)"
        }
        "ssl.endpoint.identification.algorithm" | "enable.ssl.certificate.verification" => {
            "the brokers' certificates and names are always verified"
        }
        "security.protocol" if security.tls.is_some() || security.sasl.is_some() => {
            "tls() and sasl() set it (give it without them, for a login they do not offer)"
        }
        "sasl.mechanism" | "sasl.mechanisms" | "sasl.username" | "sasl.password"
            if security.sasl.is_some() =>
        {
            "sasl() sets it"
        }
        _ if security.tls.is_some()
            && ["ssl.ca.", "ssl.certificate.", "ssl.key."]
                .iter()
                .any(|prefix| key.starts_with(prefix)) =>
        {
            "tls() sets the CA and the client certificate"
        }
        _ => return None,
    })
}

/// Why `key` (with `value`) is the crate's own for `client`, or `None`.
fn owned(client: Client, security: &Security, key: &str, value: &str) -> Option<&'static str> {
    let key = key.trim();
    if let Some(why) = owned_by_all(security, key) {
        return Some(why);
    }
    Some(match (client, key) {
        (Client::Producer, "enable.idempotence") => {
            "the producer is idempotent, so that librdkafka's retries never write a message twice"
        }
        (Client::Producer, "acks" | "request.required.acks") => {
            "a message counts as published only once every in-sync replica has it (acks=all)"
        }
        (
            Client::Producer,
            "max.in.flight.requests.per.connection"
            | "max.in.flight"
            | "retries"
            | "message.send.max.retries",
        ) => "the idempotent producer sets it, to keep each partition's order through retries",
        (Client::Producer, "transactional.id") => {
            "the producer is not transactional (the outbox's rows are the transaction): a \
             transactional one would refuse every message"
        }
        (Client::Producer, "message.timeout.ms" | "delivery.timeout.ms" | "request.timeout.ms") => {
            "it follows delivery_timeout (--confirm-timeout), so that every report comes \
             within the batch's deadline"
        }
        (Client::Producer, "message.max.bytes") => "set it with max_message_bytes",
        (Client::Producer, "partitioner") if value.trim() == "random" => {
            "a partitioner that ignores the key would scatter an aggregate's messages over \
             partitions, out of order"
        }
        (Client::Consumer, "group.id") => "the group is Source::group's argument",
        (Client::Consumer, "enable.auto.commit" | "enable.auto.offset.store") => {
            "the source commits a partition's offset only past settled messages"
        }
        (Client::Consumer, "auto.offset.reset") => "set it with start_from",
        (Client::Consumer, "enable.partition.eof") => {
            "the end of a partition is no delivery: the source would take it for an error"
        }
        (Client::Consumer | Client::Admin, "allow.auto.create.topics") => {
            "looking at a topic must not create it (a missing topic is reported)"
        }
        (Client::Admin, "message.timeout.ms" | "delivery.timeout.ms" | "request.timeout.ms") => {
            "it follows declare's wait for a broker"
        }
        _ => return None,
    })
}

/// Whether the value of the librdkafka property `key` is a secret whatever its length
/// (a password, a token, a key, a JAAS or OIDC configuration): the crate never shows it,
/// and neither should a tool that prints properties.
pub fn is_secret_property(key: &str) -> bool {
    [
        "password",
        "secret",
        "token",
        "key",
        "jaas",
        "pem",
        "credential",
        "config",
    ]
    .iter()
    .any(|word| key.contains(word))
}

/// `message` with the values of `config` taken out: those of sensitive keys, and any other
/// of four characters or more (shorter ones, `all` or `5`, would mangle the text), and
/// `also` whatever its length.
fn scrub(message: &str, config: &ClientConfig, also: Option<&str>) -> String {
    let mut values: Vec<&str> = config
        .config_map()
        .iter()
        .filter(|(key, value)| is_secret_property(key) || value.chars().count() >= 4)
        .map(|(_, value)| value.as_str())
        .chain(also)
        .filter(|value| !value.is_empty())
        .collect();
    // Longest first, so that a value is taken out whole before a part of it.
    values.sort_by_key(|value| std::cmp::Reverse(value.len()));
    values
        .into_iter()
        .fold(message.to_owned(), |text, value| text.replace(value, "***"))
}

/// What librdkafka said of `config` when it would not make a client, naming the property
/// at fault but showing none of the values (rdkafka's own text of a refused property shows
/// its value).
pub(crate) fn refused(err: &KafkaError, config: &ClientConfig) -> String {
    match err {
        KafkaError::ClientConfig(_, description, key, value) => format!(
            "librdkafka refused the property `{}`: {}",
            key.escape_debug(),
            scrub(description, config, Some(value))
        ),
        KafkaError::ClientCreation(why) => scrub(why, config, None),
        other => scrub(&other.to_string(), config, None),
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::producer::BaseProducer;

    use super::*;
    use crate::kafka::Sasl;
    use crate::tls::Tls;

    fn with(key: &str, value: &str) -> Properties {
        let mut properties = Properties::default();
        properties.push(key, value);
        properties
    }

    #[test]
    fn the_keys_the_crate_owns_are_refused_naming_the_key_never_the_value() {
        let plain = Security::default();
        for (client, key) in [
            (Client::Producer, "enable.idempotence"),
            (Client::Producer, "acks"),
            (Client::Producer, "request.required.acks"),
            (Client::Producer, "max.in.flight.requests.per.connection"),
            (Client::Producer, "retries"),
            (Client::Producer, "transactional.id"),
            (Client::Producer, "message.timeout.ms"),
            (Client::Producer, "delivery.timeout.ms"),
            (Client::Producer, "request.timeout.ms"),
            (Client::Producer, "message.max.bytes"),
            (Client::Producer, "bootstrap.servers"),
            (Client::Producer, " metadata.broker.list"),
            (Client::Producer, "enable.ssl.certificate.verification"),
            (Client::Consumer, "group.id"),
            (Client::Consumer, "enable.auto.commit"),
            (Client::Consumer, "enable.auto.offset.store"),
            (Client::Consumer, "auto.offset.reset"),
            (Client::Consumer, "allow.auto.create.topics"),
            (Client::Consumer, "enable.partition.eof"),
            (Client::Consumer, "bootstrap.servers"),
            (Client::Admin, "allow.auto.create.topics"),
            (Client::Admin, "ssl.endpoint.identification.algorithm"),
        ] {
            let err = with(key, "v4lue-s3cret")
                .check(client, &plain)
                .expect_err(key);
            assert!(
                err.contains(&format!("`{}` is the crate's own: ", key.trim())),
                "{key}: {err}"
            );
            assert!(!err.contains("v4lue-s3cret"), "{err}");
        }
        let err = with("partitioner", "random")
            .check(Client::Producer, &plain)
            .unwrap_err();
        assert!(err.contains("scatter"), "{err}");
        assert!(with("", "x").check(Client::Admin, &plain).is_err());
    }

    #[test]
    fn other_keys_pass_through_over_the_crates_defaults() {
        let plain = Security::default();
        let mut properties = with("client.id", "billing-relay");
        properties.push("compression.type", "zstd");
        properties.push("partitioner", "murmur2_random");
        properties.push("queue.buffering.max.ms", "20");
        // Not owned by the consumer or the admin client.
        properties.push("sasl.mechanism", "OAUTHBEARER");
        properties.push("security.protocol", "SASL_SSL");
        for client in [Client::Producer, Client::Consumer, Client::Admin] {
            properties.check(client, &plain).unwrap();
        }
        let mut config = ClientConfig::new();
        config
            .set("client.id", "diesel-outbox relay")
            .set("linger.ms", "2");
        properties.apply(&mut config);
        assert_eq!(config.get("client.id"), Some("billing-relay"));
        assert_eq!(config.get("queue.buffering.max.ms"), Some("20"));
        assert_eq!(config.get("linger.ms"), None, "the alias wins");
        assert_eq!(config.get("compression.type"), Some("zstd"));
        // The consumer's keys are the producer's to take, and the other way round.
        with("group.id", "g")
            .check(Client::Producer, &plain)
            .unwrap();
        with("acks", "1").check(Client::Consumer, &plain).unwrap();
        with("message.timeout.ms", "1")
            .check(Client::Consumer, &plain)
            .unwrap();
    }

    #[test]
    fn what_tls_and_sasl_set_is_theirs_once_they_are_given() {
        let given = Security {
            tls: Some(Tls::new()),
            sasl: Some(Sasl::plain("u", "p")),
        };
        for key in [
            "security.protocol",
            "sasl.mechanism",
            "sasl.username",
            "sasl.password",
            "ssl.ca.location",
            "ssl.ca.pem",
            "ssl.certificate.pem",
            "ssl.key.location",
        ] {
            let err = with(key, "x").check(Client::Producer, &given).unwrap_err();
            assert!(err.contains(&format!("`{key}`")), "{err}");
        }
        let plain = Security::default();
        for key in ["security.protocol", "sasl.mechanism", "ssl.ca.location"] {
            with(key, "x").check(Client::Producer, &plain).unwrap();
        }
    }

    #[test]
    fn a_sasl_mechanism_over_the_crates_tls_logs_in_over_tls() {
        let tls = Security {
            tls: Some(Tls::new()),
            sasl: None,
        };
        let oauth = with("sasl.mechanism", "OAUTHBEARER");
        oauth.check(Client::Producer, &tls).unwrap();
        let mut config = ClientConfig::new();
        tls.apply(&mut config).unwrap();
        oauth.apply(&mut config);
        assert_eq!(config.get("security.protocol"), Some("sasl_ssl"));
        // Without TLS, the protocol is the caller's to give.
        let mut config = ClientConfig::new();
        Security::default().apply(&mut config).unwrap();
        oauth.apply(&mut config);
        assert_eq!(config.get("security.protocol"), Some("plaintext"));
    }

    #[test]
    fn the_debug_of_properties_shows_keys_only() {
        let shown = format!("{:?}", with("sasl.password", "hunter2"));
        assert!(
            shown.contains("sasl.password") && !shown.contains("hunter2"),
            "{shown}"
        );
    }

    #[test]
    fn librdkafkas_refusal_names_the_property_without_its_value() {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("sasl.password", "pw")
            .set("compression.type", "s3cret-codec");
        let err = config.create::<BaseProducer>().err().expect("refused");
        assert!(
            err.to_string().contains("s3cret-codec"),
            "rdkafka shows it: {err}"
        );
        let told = refused(&err, &config);
        assert!(told.contains("`compression.type`"), "{told}");
        assert!(!told.contains("s3cret-codec"), "{told}");
    }

    /// The bundled librdkafka has no libcurl: it refuses the OIDC login's properties, and
    /// the refusal names the property and the cause, never a value. Making the client
    /// connects to nothing.
    #[test]
    fn the_oauthbearer_oidc_properties_pass_and_librdkafka_says_what_it_lacks() {
        let mut properties = Properties::default();
        for (key, value) in [
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "OAUTHBEARER"),
            ("sasl.oauthbearer.method", "oidc"),
            ("sasl.oauthbearer.client.id", "relay"),
            ("sasl.oauthbearer.client.secret", "s3cret"),
            (
                "sasl.oauthbearer.token.endpoint.url",
                // Nothing listens there: no token is fetched from anywhere.
                "https://127.0.0.1:1/oauth2/token",
            ),
        ] {
            properties.push(key, value);
        }
        properties
            .check(Client::Producer, &Security::default())
            .unwrap();
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", "127.0.0.1:1");
        properties.apply(&mut config);
        let err = config.create::<BaseProducer>().err().expect("no libcurl");
        let told = refused(&err, &config);
        assert!(told.contains("depends on libcurl"), "{told}");
        assert!(told.contains("`sasl.oauthbearer."), "{told}");
        assert!(
            !told.contains("s3cret") && !told.contains("127.0.0.1:1/"),
            "{told}"
        );
    }
}
