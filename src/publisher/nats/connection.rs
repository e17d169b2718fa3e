//! The link to NATS: a URL taken apart so that credentials never reach async-nats's own
//! logs, connecting, and a count of lost connections that a batch watches.

use std::str::FromStr;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::{Client, ConnectOptions, Event, ServerAddr};
use tokio::sync::watch;

const MALFORMED: &str = "the NATS URL is malformed (not shown: it may hold credentials)";

/// A NATS URL (or a comma-separated list of them) with its credentials taken out: the
/// servers without user info, and the user and password, or token, apart.
#[derive(Clone)]
pub(crate) struct Servers {
    addrs: Vec<ServerAddr>,
    credentials: Credentials,
    /// `host:port[,host:port…]`: how the servers are named in errors and logs.
    pub(crate) endpoint: String,
}

#[derive(Clone)]
enum Credentials {
    None,
    Token(String),
    UserPassword(String, String),
}

impl Servers {
    /// Parses `nats://[user:password@|token@]host[:port][,…]` (the scheme and the port may
    /// be left out: `nats://` and 4222). Errors never quote the URL.
    pub(crate) fn parse(url: &str) -> Result<Self, String> {
        let mut addrs = Vec::new();
        let mut credentials = Credentials::None;
        for part in url.split(',').map(str::trim) {
            if part.is_empty() {
                return Err(MALFORMED.into());
            }
            let addr = ServerAddr::from_str(part).map_err(|_| MALFORMED.to_owned())?;
            let mut inner = addr.into_inner();
            let user = percent_decoded(inner.username());
            let password = inner.password().map(percent_decoded);
            let found = match (user.is_empty(), password) {
                (true, None) => Credentials::None,
                (false, None) => Credentials::Token(user),
                (_, Some(password)) => Credentials::UserPassword(user, password),
            };
            if !matches!(found, Credentials::None) {
                if !matches!(credentials, Credentials::None) && !same(&credentials, &found) {
                    return Err("the NATS URLs carry different credentials; give one set".into());
                }
                credentials = found;
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
            credentials,
            endpoint,
        })
    }

    /// Connection options carrying the credentials (never inside the server addresses,
    /// which async-nats prints in its debug logs).
    fn options(&self) -> ConnectOptions {
        let options = ConnectOptions::new();
        match &self.credentials {
            Credentials::None => options,
            Credentials::Token(token) => options.token(token.clone()),
            Credentials::UserPassword(user, password) => {
                options.user_and_password(user.clone(), password.clone())
            }
        }
    }

    /// Connects, failing at once when no server answers within `timeout`. Once connected,
    /// the client reconnects by itself, for ever; every lost connection bumps the returned
    /// counter.
    pub(crate) async fn connect(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<(Client, watch::Receiver<u64>), String> {
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
        let connecting = options.connect(self.addrs.clone());
        match tokio::time::timeout(timeout + Duration::from_secs(1), connecting).await {
            Ok(Ok(client)) => Ok((client, watch)),
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
}

/// Whether the client is connected now.
pub(crate) fn connected(client: &Client) -> bool {
    client.connection_state() == State::Connected
}

fn same(a: &Credentials, b: &Credentials) -> bool {
    match (a, b) {
        (Credentials::None, Credentials::None) => true,
        (Credentials::Token(a), Credentials::Token(b)) => a == b,
        (Credentials::UserPassword(a, p), Credentials::UserPassword(b, q)) => a == b && p == q,
        _ => false,
    }
}

/// User info in a URL is percent-encoded (`%40` for `@`).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_taken_out_of_the_servers() {
        let servers = Servers::parse("nats://relay:s%40cret@mq.internal:4222").unwrap();
        assert_eq!(servers.endpoint, "mq.internal:4222");
        assert!(
            matches!(&servers.credentials, Credentials::UserPassword(u, p) if u == "relay" && p == "s@cret")
        );
        for addr in &servers.addrs {
            assert!(!format!("{addr:?}").contains("cret"), "{addr:?}");
            assert!(!addr.has_user_pass());
        }
        let token = Servers::parse("nats://t0ken@a:1, nats://b").unwrap();
        assert_eq!(token.endpoint, "a:1,b:4222");
        assert!(matches!(&token.credentials, Credentials::Token(t) if t == "t0ken"));
        assert!(matches!(
            Servers::parse("127.0.0.1:4222").unwrap().credentials,
            Credentials::None
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
}
