//! Where a RabbitMQ connection goes and how: the URL parsed once (never shown, it may hold
//! a password), the TLS files read once, and connecting with both. The publisher and the
//! consumer runner's source share it.

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::LongString;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties, DefaultConnectionBuilder};

use crate::tls::Tls;

const MALFORMED: &str = "the AMQP URL is malformed (not shown: it may hold a password)";

/// A broker to connect to.
#[derive(Clone)]
pub(crate) struct Endpoint {
    uri: AMQPUri,
    tls: OwnedTLSConfig,
    /// `host:port`, with ` vhost NAME` unless the vhost is `/` and `amqps://` before it
    /// when it is over TLS: how the broker is named in errors and logs (never the URL).
    pub(crate) name: String,
}

impl Endpoint {
    /// Parses `url` (`amqp://` or `amqps://user:pass@host:port/vhost[?auth_mechanism=external]`)
    /// and reads the files of `tls`, which needs an `amqps://` URL. Errors never quote the
    /// URL.
    pub(crate) fn new(url: &str, tls: Option<&Tls>) -> Result<Self, String> {
        let uri: AMQPUri = url.parse().map_err(|_| MALFORMED.to_owned())?;
        let secure = uri.scheme == AMQPScheme::AMQPS;
        if tls.is_some() && !secure {
            return Err("TLS settings need an amqps:// URL".into());
        }
        let mut config = OwnedTLSConfig::default();
        if let Some(tls) = tls {
            let loaded = tls.load()?;
            config.cert_chain = loaded.ca.map(|ca| ca.text);
            config.identity = loaded.client.map(|client| OwnedIdentity::PKCS8 {
                pem: client.chain.text.into_bytes(),
                key: client.key.text.into_bytes(),
            });
        }
        let name = format!(
            "{}{}:{}{}",
            if secure { "amqps://" } else { "" },
            uri.authority.host,
            uri.authority.port,
            if uri.vhost == "/" {
                String::new()
            } else {
                format!(" vhost {}", uri.vhost)
            }
        );
        Ok(Endpoint {
            uri,
            tls: config,
            name,
        })
    }

    /// Opens a connection, named `connection_name` on the broker (`rabbitmqctl
    /// list_connections client_properties` shows it). Over `amqps://` the server's
    /// certificate and name are verified against the platform's roots and the CA file.
    pub(crate) async fn connect(&self, connection_name: &str) -> lapin::Result<Connection> {
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(connection_name.to_owned()));
        DefaultConnectionBuilder::new()?
            .with_uri(self.uri.clone())
            .with_properties(properties)
            .with_tls_config(self.tls.clone())
            .connect()
            .await
    }
}
