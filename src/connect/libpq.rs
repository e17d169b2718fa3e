//! libpq's TLS parameters: taken out of a connection string (URL or `key=value` form),
//! the rest of which goes to tokio-postgres untouched, and turned into a TLS choice with
//! libpq's meaning.

use std::path::{Path, PathBuf};

use rustls::ClientConfig;
use tokio_postgres::config::SslMode as WireMode;

use super::percent_decoded;
use crate::tls::{self, ClientCert, Pem, Roots, Verify};

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            "allow" => {
                return Err(
                    "sslmode=allow is not supported: use prefer (TLS when the server offers \
                     it) or disable"
                        .into(),
                );
            }
            other => {
                return Err(format!(
                    "unknown sslmode {other:?}: use disable, prefer, require, verify-ca or \
                     verify-full"
                ));
            }
        })
    }
}

/// The TLS parameters of a connection string.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct SslParams {
    pub(super) mode: Option<SslMode>,
    pub(super) rootcert: Option<String>,
    pub(super) cert: Option<String>,
    pub(super) key: Option<String>,
}

impl SslParams {
    /// Records `key`'s value if it is one of ours; false if it is not.
    fn take(&mut self, key: &str, value: String) -> Result<bool, String> {
        match key {
            "sslmode" => self.mode = Some(SslMode::parse(&value)?),
            "sslrootcert" => self.rootcert = Some(value),
            "sslcert" => self.cert = Some(value),
            "sslkey" => self.key = Some(value),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Splits a connection string into what tokio-postgres reads and the TLS parameters.
pub(super) fn split(conninfo: &str) -> Result<(String, SslParams), String> {
    let mut params = SslParams::default();
    let url = ["postgres://", "postgresql://"]
        .iter()
        .any(|scheme| conninfo.starts_with(scheme));
    let rest = if url {
        let Some((base, query)) = conninfo.split_once('?') else {
            return Ok((conninfo.to_owned(), params));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decode = |text| {
                percent_decoded(text)
                    .ok_or("the database URL has a malformed %-escape in its parameters")
            };
            if !params.take(&decode(key)?, decode(value)?)? {
                kept.push(pair);
            }
        }
        if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        }
    } else {
        let mut kept = Vec::new();
        for (key, value, text) in keywords(conninfo)? {
            if !params.take(key, value)? {
                kept.push(text);
            }
        }
        kept.join(" ")
    };
    Ok((rest, params))
}

/// The `key = value` pairs of a keyword connection string: each key, its unquoted value,
/// and the pair's own text.
fn keywords(conninfo: &str) -> Result<Vec<(&str, String, &str)>, String> {
    let mut pairs = Vec::new();
    let mut rest = conninfo.trim_start();
    while !rest.is_empty() {
        let start = rest;
        let eq = rest
            .find('=')
            .ok_or("the connection string has a key without `= value`")?;
        let key = rest[..eq].trim();
        rest = rest[eq + 1..].trim_start();
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = if rest.starts_with('\'') {
            chars.next();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next().map(|(_, c)| c)),
                    '\'' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => value.push(c),
                }
            }
            end.ok_or("the connection string has an unterminated quoted value")?
        } else {
            let mut end = rest.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next().map(|(_, c)| c)),
                    c if c.is_whitespace() => {
                        end = i;
                        break;
                    }
                    c => value.push(c),
                }
            }
            end
        };
        let consumed = start.len() - rest.len() + end;
        pairs.push((key, value, &start[..consumed]));
        rest = rest[end..].trim_start();
    }
    Ok(pairs)
}

/// What a connection does about TLS.
#[derive(Debug)]
pub(super) struct Choice {
    /// What tokio-postgres asks the server for.
    pub(super) wire: WireMode,
    /// The TLS configuration, unless TLS is off.
    pub(super) config: Option<ClientConfig>,
}

/// libpq's meaning of the parameters:
/// - `disable`: no TLS. `prefer` (the default): TLS if the server offers it, unverified.
///   `require`: TLS or nothing; the chain is verified if a root certificate is given (as
///   `sslrootcert`, or the default `~/.postgresql/root.crt`). `verify-ca`: the chain is
///   verified. `verify-full`: the chain and the host name are verified.
/// - `sslrootcert=system` trusts the platform's roots, and then only `verify-full` is
///   allowed (and is the default), as in libpq 16.
/// - `sslcert` / `sslkey` (default `~/.postgresql/postgresql.crt` and `.key`, when they
///   exist): the client certificate.
pub(super) fn choose(params: &SslParams) -> Result<Choice, String> {
    let system = params.rootcert.as_deref() == Some("system");
    let mode = match (params.mode, system) {
        (None, true) => SslMode::VerifyFull,
        (Some(mode), true) if mode != SslMode::VerifyFull => {
            return Err("sslrootcert=system needs sslmode=verify-full (or no sslmode)".into());
        }
        (mode, _) => mode.unwrap_or(SslMode::Prefer),
    };
    if mode == SslMode::Disable {
        return Ok(Choice {
            wire: WireMode::Disable,
            config: None,
        });
    }
    let rootcert: Option<PathBuf> = match params.rootcert.as_deref() {
        Some("system") => None,
        Some(path) => Some(PathBuf::from(path)),
        None => home_file("root.crt"),
    };
    let verify = match mode {
        SslMode::Prefer => Verify::Nothing,
        SslMode::Require if rootcert.is_some() => Verify::Chain,
        SslMode::Require => Verify::Nothing,
        SslMode::VerifyCa => Verify::Chain,
        SslMode::VerifyFull | SslMode::Disable => Verify::Full,
    };
    if verify != Verify::Nothing && rootcert.is_none() && !system {
        return Err(format!(
            "sslmode={} needs a root certificate to verify the server with: set sslrootcert \
             to a PEM file, or to `system` for the platform's roots (~/.postgresql/root.crt \
             does not exist)",
            if mode == SslMode::VerifyCa {
                "verify-ca"
            } else {
                "verify-full"
            }
        ));
    }
    let ca = match (&rootcert, verify) {
        (Some(path), Verify::Chain | Verify::Full) => Some(
            Pem::certificates(path)
                .map_err(|e| format!("sslrootcert: {e}"))?
                .items,
        ),
        _ => None,
    };
    let roots = match &ca {
        Some(certs) => Roots::Only(certs),
        None => Roots::Platform,
    };
    let client = client_cert(params)?;
    let config = tls::client_config(verify, roots, client.as_ref())?;
    Ok(Choice {
        wire: if mode == SslMode::Prefer {
            WireMode::Prefer
        } else {
            WireMode::Require
        },
        config: Some(config),
    })
}

/// The client certificate: `sslcert` and `sslkey`, each defaulting to its file in
/// `~/.postgresql` when that exists.
fn client_cert(params: &SslParams) -> Result<Option<ClientCert>, String> {
    let cert = params
        .cert
        .as_deref()
        .map(PathBuf::from)
        .or_else(|| home_file("postgresql.crt"));
    let Some(cert) = cert else {
        return Ok(None);
    };
    let key = params
        .key
        .as_deref()
        .map(PathBuf::from)
        .or_else(|| home_file("postgresql.key"))
        .ok_or("sslcert needs sslkey, the client certificate's private key")?;
    ClientCert::load(&cert, &key)
        .map(Some)
        .map_err(|e| format!("sslcert/sslkey: {e}"))
}

/// `~/.postgresql/name`, if it exists.
fn home_file(name: &str) -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    let path = Path::new(&home).join(".postgresql").join(name);
    path.exists().then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parameters_are_taken_out_and_the_rest_kept_as_it_was() {
        let (rest, params) = split(
            "postgres://u:p%40ss@h1:5432,h2:5433/db?sslmode=verify-full&target_session_attrs=read-write\
             &sslrootcert=%2Fetc%2Fca.pem&application_name=a%20b&sslcert=c.pem&sslkey=k.pem",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u:p%40ss@h1:5432,h2:5433/db?target_session_attrs=read-write&application_name=a%20b"
        );
        assert_eq!(
            params,
            SslParams {
                mode: Some(SslMode::VerifyFull),
                rootcert: Some("/etc/ca.pem".into()),
                cert: Some("c.pem".into()),
                key: Some("k.pem".into()),
            }
        );
        let (rest, params) = split("postgresql://h/db?sslmode=require").unwrap();
        assert_eq!(rest, "postgresql://h/db");
        assert_eq!(params.mode, Some(SslMode::Require));
        let (rest, params) = split("postgres://h/db").unwrap();
        assert_eq!(
            (rest.as_str(), params),
            ("postgres://h/db", SslParams::default())
        );
    }

    #[test]
    fn keyword_parameters_are_taken_out_quotes_and_all() {
        let (rest, params) = split(
            "host=h1,h2 sslmode = verify-ca  password='it\\'s secret' sslrootcert='/my certs/ca.pem' dbname=db",
        )
        .unwrap();
        assert_eq!(params.mode, Some(SslMode::VerifyCa));
        assert_eq!(params.rootcert.as_deref(), Some("/my certs/ca.pem"));
        assert!(rest.starts_with("host=h1,h2 password="), "{rest}");
        assert!(rest.ends_with(" dbname=db"), "{rest}");
        assert!(!rest.contains("ssl"), "{rest}");
    }

    #[test]
    fn bad_parameters_name_the_cause_and_never_the_url() {
        let err = split("postgres://u:hunter2@h/db?sslmode=verify_full").unwrap_err();
        assert!(err.contains("unknown sslmode \"verify_full\""), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
        let allow = split("host=h sslmode=allow").unwrap_err();
        assert!(allow.contains("sslmode=allow is not supported"), "{allow}");
        assert!(
            split("host=h sslmode='x")
                .unwrap_err()
                .contains("unterminated")
        );
        assert!(
            split("postgres://h/db?sslmode=%zz")
                .unwrap_err()
                .contains("%-escape")
        );
    }

    #[test]
    fn the_mode_decides_what_is_verified() {
        let choose_with = |url: &str| split(url).and_then(|(_, p)| choose(&p));
        let prefer = choose_with("postgres://h/db").unwrap();
        assert_eq!(prefer.wire, WireMode::Prefer);
        assert!(prefer.config.is_some());
        let disable = choose_with("postgres://h/db?sslmode=disable").unwrap();
        assert_eq!(disable.wire, WireMode::Disable);
        assert!(disable.config.is_none());
        assert_eq!(
            choose_with("postgres://h/db?sslmode=require").unwrap().wire,
            WireMode::Require
        );
        assert_eq!(
            choose_with("postgres://h/db?sslrootcert=system")
                .unwrap()
                .wire,
            WireMode::Require
        );
        let weak = choose_with("postgres://h/db?sslrootcert=system&sslmode=require");
        assert!(weak.unwrap_err().contains("needs sslmode=verify-full"));
        let missing =
            choose_with("postgres://h/db?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem");
        let missing = missing.unwrap_err();
        assert!(
            missing.contains("cannot read the certificate file /nonexistent/ca.pem"),
            "{missing}"
        );
        let key_only = choose_with("postgres://h/db?sslcert=/nonexistent/c.pem&sslmode=require");
        assert!(key_only.is_err());
    }
}
