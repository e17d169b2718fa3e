//! The link to NATS: a URL taken apart so that credentials never reach async-nats's own
//! logs, the credentials and TLS the builders add, connecting, and a count of lost
//! connections that a batch watches.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::{Client, ConnectOptions, Event, ServerAddr};
use tokio::sync::watch;

use crate::connect::percent_decoded;
use crate::tls::{self, Roots, Tls, Verify};

const MALFORMED: &str = "the NATS URL is malformed (not shown: it may hold credentials)";

/// How a NATS client logs in, for servers that ask: a credentials file, an NKey seed, a
/// token, or a user and password (which a URL can also carry, as `user:password@` or
/// `token@`; give them one way only). Its `Debug` never shows a secret.
///
/// ```
/// use diesel_outbox::nats::Credentials;
///
/// let creds = Credentials::file("/run/secrets/outbox.creds");
/// let seed = Credentials::nkey_seed(std::env::var("NATS_NKEY_SEED").unwrap_or_default());
/// # let _ = (creds, seed);
/// ```
#[derive(Clone)]
pub struct Credentials(Login);

#[derive(Clone)]
enum Login {
    None,
    Token(String),
    UserPassword(String, String),
    NKeySeed(String),
    /// A `.creds` file: its path, and once read its contents.
    File(PathBuf, Option<Arc<str>>),
}

impl Credentials {
    /// A `.creds` file (a user JWT and its NKey seed), as NGS and Synadia Cloud issue
    /// them. It is read when the publisher connects or the source is built.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        Credentials(Login::File(path.into(), None))
    }

    /// An NKey seed (`SU…`): the client signs the server's challenge with it.
    pub fn nkey_seed(seed: impl Into<String>) -> Self {
        Credentials(Login::NKeySeed(seed.into()))
    }

    /// A token.
    pub fn token(token: impl Into<String>) -> Self {
        Credentials(Login::Token(token.into()))
    }

    /// A user and password.
    pub fn user_and_password(user: impl Into<String>, password: impl Into<String>) -> Self {
        Credentials(Login::UserPassword(user.into(), password.into()))
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Login::None => f.write_str("Credentials::None"),
            Login::Token(_) => f.write_str("Credentials::Token(***)"),
            Login::UserPassword(user, _) => write!(f, "Credentials::UserPassword({user:?}, ***)"),
            Login::NKeySeed(_) => f.write_str("Credentials::NKeySeed(***)"),
            Login::File(path, _) => write!(f, "Credentials::File({path:?})"),
        }
    }
}

/// A NATS URL (or a comma-separated list of them) with its credentials taken out, and what
/// the builder added: the servers without user info, how to log in, and the TLS to use.
#[derive(Clone)]
pub(crate) struct Servers {
    addrs: Vec<ServerAddr>,
    login: Login,
    tls: Option<Arc<rustls::ClientConfig>>,
    /// `host:port[,host:port…]`: how the servers are named in errors and logs.
    pub(crate) endpoint: String,
}

impl Servers {
    /// Parses `nats://[user:password@|token@]host[:port][,…]` (the scheme and the port may
    /// be left out: `nats://` and 4222; `tls://` asks for TLS). Errors never quote the URL.
    pub(crate) fn parse(url: &str) -> Result<Self, String> {
        let mut addrs = Vec::new();
        let mut login = Login::None;
        for part in url.split(',').map(str::trim) {
            if part.is_empty() {
                return Err(MALFORMED.into());
            }
            let addr = ServerAddr::from_str(part).map_err(|_| MALFORMED.to_owned())?;
            let mut inner = addr.into_inner();
            let user = percent_decoded(inner.username()).ok_or(MALFORMED)?;
            let password = match inner.password() {
                Some(password) => Some(percent_decoded(password).ok_or(MALFORMED)?),
                None => None,
            };
            let found = match (user.is_empty(), password) {
                (true, None) => Login::None,
                (false, None) => Login::Token(user),
                (_, Some(password)) => Login::UserPassword(user, password),
            };
            if !matches!(found, Login::None) {
                if !matches!(login, Login::None) && !same(&login, &found) {
                    return Err("the NATS URLs carry different credentials; give one set".into());
                }
                login = found;
            }
            inner
                .set_password(None)
                .and_then(|()| inner.set_username(""))
                .map_err(|()| MALFORMED.to_owned())?;
            addrs.push(ServerAddr::from_url(inner).map_err(|_| MALFORMED.to_owned())?);
        }
        let endpoint = addrs
            .iter()
            .map(|a| format!("{}:{}", a.host(), a.port()))
            .collect::<Vec<_>>()
            .join(",");
        Ok(Servers {
            addrs,
            login,
            tls: None,
            endpoint,
        })
    }

    /// Logs in with `credentials`, which must not come on top of credentials in the URL. A
    /// credentials file is read (and its content checked), an NKey seed checked, now.
    pub(crate) fn with_credentials(mut self, credentials: &Credentials) -> Result<Self, String> {
        if !matches!(self.login, Login::None) {
            return Err(
                "NATS credentials given twice: in the URL and as credentials; give them one way"
                    .into(),
            );
        }
        self.login = match &credentials.0 {
            Login::File(path, _) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!(
                        "cannot read the NATS credentials file {}: {e}",
                        path.display()
                    )
                })?;
                ConnectOptions::with_credentials(&text).map_err(|e| {
                    format!("{} is not a NATS credentials file: {e}", path.display())
                })?;
                Login::File(path.clone(), Some(text.into()))
            }
            Login::NKeySeed(seed) => {
                nkeys::KeyPair::from_seed(seed)
                    .map_err(|_| "the NKey seed is not valid (not shown)".to_owned())?;
                Login::NKeySeed(seed.clone())
            }
            login => login.clone(),
        };
        Ok(self)
    }

    /// Connects over TLS (whatever the URL's scheme says), verifying the server's
    /// certificate and name against the platform's roots and the CA file of `tls`, and
    /// showing its client certificate. The files are read now.
    pub(crate) fn with_tls(mut self, tls: &Tls) -> Result<Self, String> {
        let loaded = tls.load()?;
        let ca = loaded.ca.map(|ca| ca.items).unwrap_or_default();
        let config = tls::client_config(
            Verify::Full,
            Roots::PlatformAnd(&ca),
            loaded.client.as_ref(),
        )?;
        self.tls = Some(Arc::new(config));
        Ok(self)
    }

    /// Connection options carrying the credentials (never inside the server addresses,
    /// which async-nats prints in its debug logs) and the TLS configuration.
    fn options(&self) -> ConnectOptions {
        let mut options = match &self.login {
            Login::None => ConnectOptions::new(),
            Login::Token(token) => ConnectOptions::new().token(token.clone()),
            Login::UserPassword(user, password) => {
                ConnectOptions::new().user_and_password(user.clone(), password.clone())
            }
            Login::NKeySeed(seed) => ConnectOptions::new().nkey(seed.clone()),
            // Checked when it was read.
            Login::File(_, text) => ConnectOptions::with_credentials(text.as_deref().unwrap_or(""))
                .unwrap_or_else(|_| ConnectOptions::new()),
        };
        match &self.tls {
            Some(config) => {
                options = options
                    .tls_client_config((**config).clone())
                    .require_tls(true);
            }
            // For a `tls://` URL or a server that requires TLS: verified against the
            // platform's roots, on the crate's crypto provider (async-nats's own
            // configuration would take the process's default provider, which is ambiguous
            // when both of rustls's providers are compiled in).
            None => {
                if let Ok(config) = tls::client_config(Verify::Full, Roots::Platform, None) {
                    options = options.tls_client_config(config);
                }
            }
        }
        options
    }
    /// Connects, failing at once when no server answers within `timeout`. Once connected,
    /// the client reconnects by itself, for ever; every lost connection bumps the returned
    /// counter.
    pub(crate) async fn connect(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<(Client, watch::Receiver<u64>), String> {
        let (options, lost) = self.client_options(name, timeout);
        let connecting = options.connect(self.addrs.clone());
        match tokio::time::timeout(timeout + Duration::from_secs(1), connecting).await {
            Ok(Ok(client)) => Ok((client, lost)),
            Ok(Err(e)) => Err(format!(
                "connecting to NATS at {} failed: {e}",
                self.endpoint
            )),
            Err(_) => Err(format!(
                "connecting to NATS at {}: no answer within {timeout:?}",
                self.endpoint
            )),
        }
    }

    /// A client that connects in the background, now or once a server answers, and then
    /// as [`Servers::connect`]'s.
    pub(crate) async fn connect_lazy(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<(Client, watch::Receiver<u64>), String> {
        let (options, lost) = self.client_options(name, timeout);
        let client = options
            .retry_on_initial_connect()
            .connect(self.addrs.clone())
            .await
            .map_err(|e| format!("starting a NATS client for {} failed: {e}", self.endpoint))?;
        Ok((client, lost))
    }

    /// The client's options: named `name`, each connection attempt within `timeout`,
    /// reconnecting for ever, every lost connection counted.
    fn client_options(
        &self,
        name: &str,
        timeout: Duration,
    ) -> (async_nats::ConnectOptions, watch::Receiver<u64>) {
        let (lost, watch) = watch::channel(0u64);
        let endpoint = self.endpoint.clone();
        let options = self
            .options()
            .name(name)
            .connection_timeout(timeout)
            .max_reconnects(None)
            .event_callback(move |event| {
                match &event {
                    Event::Disconnected => {
                        lost.send_modify(|n| *n += 1);
                        tracing::debug!(endpoint = %endpoint, "lost the connection to NATS");
                    }
                    Event::Connected => {
                        tracing::debug!(endpoint = %endpoint, "connected to NATS");
                    }
                    _ => {}
                }
                std::future::ready(())
            });
        (options, watch)
    }
}

/// Whether the client is connected now.
pub(crate) fn connected(client: &Client) -> bool {
    client.connection_state() == State::Connected
}

fn same(a: &Login, b: &Login) -> bool {
    match (a, b) {
        (Login::Token(a), Login::Token(b)) => a == b,
        (Login::UserPassword(a, p), Login::UserPassword(b, q)) => a == b && p == q,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_taken_out_of_the_servers() {
        let servers = Servers::parse("nats://relay:s%40cret@mq.internal:4222").unwrap();
        assert_eq!(servers.endpoint, "mq.internal:4222");
        assert!(
            matches!(&servers.login, Login::UserPassword(u, p) if u == "relay" && p == "s@cret")
        );
        for addr in &servers.addrs {
            assert!(!format!("{addr:?}").contains("cret"), "{addr:?}");
            assert!(!addr.has_user_pass());
        }
        let token = Servers::parse("nats://t0ken@a:1, nats://b").unwrap();
        assert_eq!(token.endpoint, "a:1,b:4222");
        assert!(matches!(&token.login, Login::Token(t) if t == "t0ken"));
        assert!(matches!(
            Servers::parse("127.0.0.1:4222").unwrap().login,
            Login::None
        ));
    }

    #[test]
    fn a_bad_url_is_refused_without_being_quoted() {
        for bad in ["nats://u:s3cret@[bad", "", "nats://a:1,,nats://b:2"] {
            let err = Servers::parse(bad).err().expect(bad);
            assert!(
                !err.contains("s3cret") && err.contains("malformed"),
                "{err}"
            );
        }
        let err = Servers::parse("nats://u:one@a,nats://u:two@b")
            .err()
            .unwrap();
        assert!(
            err.contains("different credentials") && !err.contains("two"),
            "{err}"
        );
    }

    #[test]
    fn credentials_come_one_way_are_checked_when_given_and_never_shown() {
        let url_and_builder = Servers::parse("nats://tok@a:1")
            .unwrap()
            .with_credentials(&Credentials::token("other"))
            .err()
            .unwrap();
        assert!(url_and_builder.contains("given twice"), "{url_and_builder}");
        let seed = Servers::parse("nats://a:1")
            .unwrap()
            .with_credentials(&Credentials::nkey_seed("SUnot-a-seed-s3cret"))
            .err()
            .unwrap();
        assert!(
            seed.contains("not valid") && !seed.contains("s3cret"),
            "{seed}"
        );
        let good = nkeys::KeyPair::new_user().seed().unwrap();
        assert!(
            Servers::parse("nats://a:1")
                .unwrap()
                .with_credentials(&Credentials::nkey_seed(&good))
                .is_ok()
        );
        let missing = Servers::parse("nats://a:1")
            .unwrap()
            .with_credentials(&Credentials::file("/nonexistent/outbox.creds"))
            .err()
            .unwrap();
        assert!(
            missing.contains("cannot read the NATS credentials file /nonexistent/outbox.creds"),
            "{missing}"
        );
        for (creds, secret) in [
            (Credentials::nkey_seed(good.as_str()), good.as_str()),
            (Credentials::token("t0ken"), "t0ken"),
            (Credentials::user_and_password("u", "pa55"), "pa55"),
        ] {
            let shown = format!("{creds:?}");
            assert!(!shown.contains(secret) && shown.contains("***"), "{shown}");
        }
    }
}
