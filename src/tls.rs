//! TLS for the connections the crate opens: which certificates to trust and which client
//! certificate to show, read from PEM files once, with errors that name the file and the
//! cause. PostgreSQL takes them from libpq's URL parameters (`connect.rs`); the brokers from
//! their builders' `tls` option ([`Tls`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ClientConfig, WebPkiServerVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// TLS settings for a broker connection: certificate authorities to trust besides the
/// platform's, and a client certificate to show.
///
/// The server's certificate is always verified, its name included: against the platform's
/// trusted roots, and the CAs of [`Tls::ca_file`] if given. Files are read when the
/// publisher or source connects; a missing or unreadable file, or one without a PEM
/// certificate (or key), is an [`Error::InvalidOption`](crate::Error::InvalidOption) naming
/// the file.
///
/// ```
/// use diesel_outbox::Tls;
///
/// let tls = Tls::new()
///     .ca_file("/etc/outbox/ca.pem")
///     .client_cert("/etc/outbox/relay.pem", "/etc/outbox/relay.key");
/// # let _ = tls;
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tls {
    ca_file: Option<PathBuf>,
    client_cert: Option<(PathBuf, PathBuf)>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca_file", &self.ca_file)
            .field(
                "client_cert",
                &self.client_cert.as_ref().map(|(cert, _)| cert),
            )
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// TLS verified against the platform's trusted roots, without a client certificate.
    pub fn new() -> Self {
        Tls::default()
    }

    /// Also trusts the certificate authorities in this PEM file (a private CA, say).
    /// Defaults to the platform's roots alone.
    #[must_use]
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Shows this client certificate (a PEM file, its chain after it) with its private key
    /// (a PEM file: PKCS#8, PKCS#1 or SEC1), for servers that authenticate clients by
    /// certificate. Defaults to none.
    #[must_use]
    pub fn client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_cert = Some((cert.into(), key.into()));
        self
    }

    /// Reads the files.
    #[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
    pub(crate) fn load(&self) -> Result<Loaded, String> {
        let ca = self.ca_file.as_deref().map(Pem::certificates).transpose()?;
        let client = self
            .client_cert
            .as_ref()
            .map(|(cert, key)| ClientCert::load(cert, key))
            .transpose()?;
        Ok(Loaded { ca, client })
    }
}

/// One PEM file's text and what it holds.
#[derive(Clone)]
pub(crate) struct Pem<T> {
    /// The file's text, as lapin takes it.
    #[cfg_attr(not(any(feature = "rabbitmq", feature = "kafka")), allow(dead_code))]
    pub(crate) text: String,
    pub(crate) items: T,
}

impl Pem<Vec<CertificateDer<'static>>> {
    /// The certificates in the PEM file at `path` (at least one).
    pub(crate) fn certificates(path: &Path) -> Result<Self, String> {
        let text = read(path, "certificate file")?;
        let items = CertificateDer::pem_slice_iter(text.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{} is not a valid PEM file: {e}", path.display()))?;
        if items.is_empty() {
            return Err(format!("{} holds no PEM certificate", path.display()));
        }
        Ok(Pem { text, items })
    }
}

/// A client certificate and its key.
pub(crate) struct ClientCert {
    pub(crate) chain: Pem<Vec<CertificateDer<'static>>>,
    pub(crate) key: Pem<PrivateKeyDer<'static>>,
}

impl ClientCert {
    pub(crate) fn load(cert: &Path, key: &Path) -> Result<Self, String> {
        let chain = Pem::certificates(cert)?;
        let text = read(key, "client key")?;
        // The key's text is never shown, nor what the parser says about it.
        let items = PrivateKeyDer::from_pem_slice(text.as_bytes())
            .map_err(|_| format!("{} holds no PEM private key", key.display()))?;
        Ok(ClientCert {
            chain,
            key: Pem { text, items },
        })
    }
}

fn read(path: &Path, what: &str) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))
}

/// A [`Tls`] with its files read.
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
pub(crate) struct Loaded {
    pub(crate) ca: Option<Pem<Vec<CertificateDer<'static>>>>,
    pub(crate) client: Option<ClientCert>,
}

/// How much of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verify {
    /// The chain to a trusted root, and the name connected to.
    Full,
    /// The chain to a trusted root, whatever name it is for (libpq's `verify-ca`).
    Chain,
    /// Nothing: encryption only (libpq's `require` and `prefer` without a root
    /// certificate).
    Nothing,
}

/// The roots a verified connection trusts.
pub(crate) enum Roots<'a> {
    /// The platform's trusted roots.
    Platform,
    /// These certificates only.
    Only(&'a [CertificateDer<'static>]),
    /// The platform's and these (NATS's `Tls`; RabbitMQ's goes through lapin's own).
    #[cfg(feature = "nats")]
    PlatformAnd(&'a [CertificateDer<'static>]),
}

/// A rustls client configuration on the crate's one crypto provider (ring).
pub(crate) fn client_config(
    verify: Verify,
    roots: Roots<'_>,
    client: Option<&ClientCert>,
) -> Result<ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?;
    let builder = match verify {
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(
                provider.signature_verification_algorithms,
            ))),
        Verify::Full | Verify::Chain => {
            let store = Arc::new(root_store(roots)?);
            let webpki = WebPkiServerVerifier::builder_with_provider(store, provider)
                .build()
                .map_err(|e| format!("TLS set-up: {e}"))?;
            if verify == Verify::Full {
                builder.with_webpki_verifier(webpki)
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyName(webpki)))
            }
        }
    };
    match client {
        Some(cert) => builder
            .with_client_auth_cert(cert.chain.items.clone(), cert.key.items.clone_key())
            .map_err(|e| format!("the client certificate and key do not go together: {e}")),
        None => Ok(builder.with_no_client_auth()),
    }
}

fn root_store(roots: Roots<'_>) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    let (platform, extra): (bool, &[CertificateDer<'static>]) = match roots {
        Roots::Platform => (true, &[]),
        Roots::Only(certs) => (false, certs),
        #[cfg(feature = "nats")]
        Roots::PlatformAnd(certs) => (true, certs),
    };
    if platform {
        // Certificates the platform keeps that rustls cannot use are left out, as browsers
        // do; an empty platform store only matters when nothing else is trusted.
        let found = rustls_native_certs::load_native_certs();
        store.add_parsable_certificates(found.certs);
    }
    for cert in extra {
        store
            .add(cert.clone())
            .map_err(|e| format!("a CA certificate cannot be used: {e}"))?;
    }
    if store.is_empty() {
        return Err("no trusted root certificates: the platform has none; give a CA file".into());
    }
    Ok(store)
}

/// Checks the chain, not the name: libpq's `verify-ca`.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Accepts any certificate (the handshake's signatures are still checked): encryption
/// without authentication, as libpq's `require` without a root certificate.
#[derive(Debug)]
struct Unverified(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}
