//! TLS: certificates for `tls_listen`, SNI, ALPN, and the client side of `https` upstreams
//! (contract §2: `tls_listen`, `[[server.certs]]`, upstream `ca_file` and `http2`).
//!
//! This module owns everything that turns PEM files into rustls configurations:
//!
//! - [`load_certified_key`] reads one `[[server.certs]]` entry (a PEM chain, leaf first, and a
//!   PKCS#8, PKCS#1 or SEC1 private key) and refuses it when the key does not belong to the
//!   leaf or the leaf is outside its validity period, so a bad file fails at start or at
//!   reload (where the old configuration keeps serving) instead of at the first handshake.
//! - [`SniResolver`] picks, per handshake, the first certificate whose subject alternative
//!   names match the client's SNI (RFC 6066 section 3), with webpki's matching rules, wildcards
//!   included; without SNI, or when nothing matches, the first certificate is the default.
//! - [`server_config`] builds the immutable [`rustls::ServerConfig`] for the TLS listeners.
//!   Reload builds a fresh one and the server swaps the `Arc`; handshakes already running keep
//!   the configuration they started with.
//! - [`client_config`] builds the [`rustls::ClientConfig`] for `https` upstreams: Mozilla's
//!   roots (webpki-roots) plus the upstream's optional `ca_file`.
//!
//! Both sides speak TLS 1.2 and 1.3 only, with rustls' default (forward-secret, AEAD-only)
//! cipher suites. The crypto provider is *ring*, passed explicitly to every builder rather
//! than installed process-wide: ring needs only a C compiler to build (aws-lc-rs also needs
//! cmake, and nasm on Windows), and an explicit provider cannot be changed behind our back by
//! another crate installing a different default.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::verify_server_name;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::version::{TLS12, TLS13};
use rustls::{
    ClientConfig, DigitallySignedStruct, InconsistentKeys, RootCertStore, ServerConfig,
    SignatureScheme, SupportedProtocolVersion,
};

/// The protocol versions both sides accept. Anything older (TLS 1.1, 1.0, SSL) is refused
/// during the handshake.
const PROTOCOL_VERSIONS: &[&SupportedProtocolVersion] = &[&TLS13, &TLS12];

pub(crate) const ALPN_H2: &[u8] = b"h2";
const ALPN_HTTP11: &[u8] = b"http/1.1";

/// A leaf certificate expiring sooner than this is logged as a warning when loaded.
const EXPIRY_WARNING_SECS: i64 = 14 * 24 * 3600;

/// Why a certificate, key or CA file cannot be used. Every message names the file; none
/// contains key material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("no TLS certificate configured: tls_listen needs at least one [[server.certs]] entry")]
    NoCertificates,

    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },

    #[error("{}: malformed PEM: {source}", path.display())]
    Pem { path: PathBuf, source: pem::Error },

    #[error("{}: no certificate found (expected a PEM \"BEGIN CERTIFICATE\" block)", path.display())]
    NoCertificate { path: PathBuf },

    #[error(
        "{}: no private key found (expected a PEM \"BEGIN PRIVATE KEY\", \"BEGIN RSA PRIVATE KEY\" \
         or \"BEGIN EC PRIVATE KEY\" block)",
        path.display()
    )]
    NoPrivateKey { path: PathBuf },

    #[error("{}: the private key is encrypted; tollgate needs an unencrypted key", path.display())]
    EncryptedPrivateKey { path: PathBuf },

    #[error("{}: {count} private keys found; expected exactly one", path.display())]
    SeveralPrivateKeys { path: PathBuf, count: usize },

    #[error("{}: unusable private key: {source}", path.display())]
    BadPrivateKey {
        path: PathBuf,
        source: rustls::Error,
    },

    #[error("{}: invalid certificate: {reason}", path.display())]
    BadCertificate { path: PathBuf, reason: String },

    #[error(
        "private key {} does not match the certificate {} (the leaf certificate must come first \
         in the chain)",
        key.display(),
        cert.display()
    )]
    KeyMismatch { cert: PathBuf, key: PathBuf },

    #[error("{}: certificate expired at {not_after}", path.display())]
    Expired { path: PathBuf, not_after: CertTime },

    #[error("{}: certificate is not valid before {not_before}", path.display())]
    NotYetValid { path: PathBuf, not_before: CertTime },

    #[error("{}: unusable CA certificate: {source}", path.display())]
    BadCaCertificate {
        path: PathBuf,
        source: rustls::Error,
    },

    #[error("TLS configuration: {0}")]
    Config(#[source] rustls::Error),
}

/// One `[[server.certs]]` entry: a PEM chain and its private key.
#[derive(Debug, Clone)]
pub struct CertConfig {
    /// Resolved against the config file's directory when relative.
    pub cert: PathBuf,
    pub key: PathBuf,
}

// The TLS set-up's failures at start, as the one line `tollgate run` prints.
impl From<TlsError> for crate::error::StartupError {
    fn from(e: TlsError) -> Self {
        crate::error::StartupError::Tls(crate::error::Detail::of(e))
    }
}

/// The crypto provider for every config this module builds.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Builds the server config for `tls_listen`: TLS 1.2 and 1.3, ALPN `h2` then `http/1.1`,
/// certificates chosen by [`SniResolver`] (the first is the default).
pub fn server_config(certs: &[CertConfig]) -> Result<Arc<ServerConfig>, TlsError> {
    let resolver = SniResolver::load(certs)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .map_err(TlsError::Config)?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec()];
    Ok(Arc::new(config))
}

/// Loads one `[[server.certs]]` entry: a PEM chain (leaf first) and a PEM private key
/// (PKCS#8, PKCS#1 or SEC1). Refuses a key that does not belong to the leaf and a leaf that
/// is expired or not yet valid.
pub fn load_certified_key(cert: &CertConfig) -> Result<Arc<CertifiedKey>, TlsError> {
    load_certified_key_at(cert, unix_now())
}

fn load_certified_key_at(cert: &CertConfig, now: i64) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = read_certificates(&cert.cert)?;
    let key = read_private_key(&cert.key)?;
    let bad_cert = |reason: String| TlsError::BadCertificate {
        path: cert.cert.clone(),
        reason,
    };

    let leaf = &chain[0];
    ParsedCertificate::try_from(leaf).map_err(|e| bad_cert(e.to_string()))?;
    let validity = Validity::from_der(leaf)
        .map_err(|e| bad_cert(format!("cannot read its validity period ({e})")))?;

    let signing_key = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|source| TlsError::BadPrivateKey {
            path: cert.key.clone(),
            source,
        })?;
    let certified = CertifiedKey::new(chain, signing_key);
    match certified.keys_match() {
        Ok(()) => {}
        Err(rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch)) => {
            return Err(TlsError::KeyMismatch {
                cert: cert.cert.clone(),
                key: cert.key.clone(),
            });
        }
        // Every ring key type can derive its public key, so this is not expected; rustls'
        // own loader accepts such a key too, and the handshake would still fail loudly.
        Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => {
            tracing::warn!(
                key = %cert.key.display(),
                "cannot check that the private key matches its certificate"
            );
        }
        Err(e) => return Err(bad_cert(e.to_string())),
    }

    if now < validity.not_before.unix {
        return Err(TlsError::NotYetValid {
            path: cert.cert.clone(),
            not_before: validity.not_before,
        });
    }
    if now > validity.not_after.unix {
        return Err(TlsError::Expired {
            path: cert.cert.clone(),
            not_after: validity.not_after,
        });
    }
    if validity.not_after.unix - now < EXPIRY_WARNING_SECS {
        tracing::warn!(
            cert = %cert.cert.display(),
            not_after = %validity.not_after,
            "TLS certificate expires soon"
        );
    }
    tracing::debug!(
        cert = %cert.cert.display(),
        not_after = %validity.not_after,
        "loaded TLS certificate"
    );
    Ok(Arc::new(certified))
}

/// Builds the client config for `https` upstreams: Mozilla's roots plus every certificate in
/// `ca_file`; ALPN `h2` when `http2`, `http/1.1` otherwise; TLS 1.2 and 1.3.
pub fn client_config(ca_file: Option<&Path>, http2: bool) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        for cert in read_certificates(path)? {
            roots
                .add(cert)
                .map_err(|source| TlsError::BadCaCertificate {
                    path: path.to_path_buf(),
                    source,
                })?;
        }
    }
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .map_err(TlsError::Config)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![if http2 { ALPN_H2 } else { ALPN_HTTP11 }.to_vec()];
    Ok(Arc::new(config))
}

/// Chooses the server certificate for a handshake from the client's SNI.
///
/// The certificates are kept in configuration order; the first one whose names match the SNI
/// (webpki's rules: subject alternative dNSNames, a wildcard covering exactly one label) wins,
/// and the first certificate is the default. Matching parses each candidate's leaf, which
/// costs microseconds against the milliseconds of a handshake's public-key operations.
pub struct SniResolver {
    certs: Vec<LoadedCert>,
}

struct LoadedCert {
    /// The certificate file, for logs and `Debug`.
    source: PathBuf,
    key: Arc<CertifiedKey>,
}

impl SniResolver {
    /// Loads every entry with [`load_certified_key`]; the first is the default.
    pub fn load(certs: &[CertConfig]) -> Result<Self, TlsError> {
        if certs.is_empty() {
            return Err(TlsError::NoCertificates);
        }
        let certs = certs
            .iter()
            .map(|c| {
                Ok(LoadedCert {
                    source: c.cert.clone(),
                    key: load_certified_key(c)?,
                })
            })
            .collect::<Result<Vec<_>, TlsError>>()?;
        Ok(Self { certs })
    }

    /// The certificate for a client that sent `sni` (or none).
    fn choose(&self, sni: Option<&str>) -> Option<&LoadedCert> {
        let matching = sni
            .and_then(|name| ServerName::try_from(name).ok())
            .and_then(|name| self.certs.iter().find(|c| c.serves(&name)));
        matching.or_else(|| self.certs.first())
    }
}

impl LoadedCert {
    fn serves(&self, name: &ServerName<'_>) -> bool {
        self.key
            .end_entity_cert()
            .and_then(ParsedCertificate::try_from)
            .and_then(|leaf| verify_server_name(&leaf, name))
            .is_ok()
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.choose(client_hello.server_name())
            .map(|c| Arc::clone(&c.key))
    }
}

impl fmt::Debug for SniResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SniResolver")
            .field(
                "certs",
                &self.certs.iter().map(|c| &c.source).collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Every PEM section of type `T` in `bytes`, in file order; sections of other types are
/// skipped, a section that does not decode is an error.
fn read_pem<T: PemObject>(path: &Path, bytes: &[u8]) -> Result<Vec<T>, TlsError> {
    T::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: path.to_path_buf(),
            source,
        })
}

/// Every certificate in a PEM file, in file order; at least one.
fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read_file(path)?;
    let certs = read_pem::<CertificateDer<'static>>(path, &bytes)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The one private key (PKCS#8, PKCS#1 or SEC1) in a PEM file.
fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read_file(path)?;
    // The PEM reader skips encrypted PKCS#8 blocks (an unknown section type) and cannot
    // decode the legacy OpenSSL encryption headers; say what is wrong instead of "no key"
    // or "malformed".
    let encrypted = |marker: &[u8]| bytes.windows(marker.len()).any(|w| w == marker);
    if encrypted(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") || encrypted(b"Proc-Type: 4,ENCRYPTED") {
        return Err(TlsError::EncryptedPrivateKey {
            path: path.to_path_buf(),
        });
    }
    let mut keys = read_pem::<PrivateKeyDer<'static>>(path, &bytes)?;
    match keys.len() {
        0 => Err(TlsError::NoPrivateKey {
            path: path.to_path_buf(),
        }),
        1 => Ok(keys.remove(0)),
        count => Err(TlsError::SeveralPrivateKeys {
            path: path.to_path_buf(),
            count,
        }),
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// A certificate's `notBefore` / `notAfter` (RFC 5280 section 4.1.2.5), UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CertTime {
    /// Seconds since the Unix epoch.
    pub unix: i64,
    year: i64,
    month: u8,
    day: u8,
    hour: u8,
    minute: u8,
    second: u8,
}

impl fmt::Display for CertTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

/// A leaf's validity period, read with x509-parser: rustls and webpki check validity only
/// while verifying a chain and do not expose the dates. webpki has already parsed the
/// certificate when this runs; any surprise here is reported, not trusted.
#[derive(Debug, Clone, Copy)]
struct Validity {
    not_before: CertTime,
    not_after: CertTime,
}

impl Validity {
    /// Why the DER cannot be read, in x509-parser's words, as the error.
    fn from_der(cert: &[u8]) -> Result<Self, String> {
        let (_, parsed) = x509_parser::parse_x509_certificate(cert).map_err(|e| match e {
            x509_parser::nom::Err::Incomplete(_) => "truncated".to_owned(),
            x509_parser::nom::Err::Error(e) | x509_parser::nom::Err::Failure(e) => e.to_string(),
        })?;
        let validity = parsed.validity();
        Ok(Self {
            not_before: CertTime::from(&validity.not_before),
            not_after: CertTime::from(&validity.not_after),
        })
    }
}

impl From<&x509_parser::time::ASN1Time> for CertTime {
    fn from(time: &x509_parser::time::ASN1Time) -> Self {
        let utc = time.to_datetime();
        CertTime {
            unix: utc.unix_timestamp(),
            year: i64::from(utc.year()),
            month: u8::from(utc.month()),
            day: utc.day(),
            hour: utc.hour(),
            minute: utc.minute(),
            second: utc.second(),
        }
    }
}

/// A server certificate verifier that accepts any certificate, though the handshake signature
/// must still be made by the certificate's key: encryption without authentication. For
/// PostgreSQL's `sslmode=prefer` and `require` (libpq's meaning of these modes), and for tests
/// that must see which certificate a server chose.
#[derive(Debug)]
pub(crate) struct SignaturesOnly(pub(crate) Arc<CryptoProvider>);

impl ServerCertVerifier for SignaturesOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use std::process::Stdio;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    use rustls::ProtocolVersion;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    use super::*;

    // Test-only keys, generated once with `openssl genpkey` / `openssl ecparam` and converted
    // with `openssl pkey`: rcgen on ring can neither generate RSA keys nor write PKCS#1 or
    // SEC1, and those are the formats under test. Each pair is one key in two encodings.
    const RSA_PKCS8: &str = "\
-----BEGIN PRIVATE KEY-----
MIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgwggSkAgEAAoIBAQC859CHU0Faz3rD
e1N83T/Oimf/umvt5sSC4vrwIC1WWIL/3SVkIhO7AaNYf9u/BWXy7vMTh5oYL983
Alg1A0psoEsjOQoG/nfScTjQ5hHGzxIEHz/ZnJykpC04b4u1XN0ZApAUcb3BW0i9
AWVJ/brH6jKDJOkO9AeZXaaabKSdOpWO3cMkt6sXirMAUWJ25T7iev0CvqGKl2Dv
GI5WXyMXbYcjpRAWTiuoC1CvG4X1IjXd3ULhWQh3ypfzU6z//hrY3mKZoc6VC/nU
FxE+dr3iYGvRRsS0QUPU+jkT5i2RDdIISd5nQvqdVo8Hk6cFybLzCUzMGV5KpoBH
fHIqNev/AgMBAAECggEACof+sn/Y6OMgPCQOWquxXvMmxE70Rv/SfMMcRXH4+3m7
wKy0S1ZkmzK5x7lF2urGIDqW1CpL7bh3GgeVCBkpRDah4B84VX0Vcpn1SbZ9AmrE
EMH21H7l2X5Kako6ehK1ql55aDcr4petANYPFSAcEmd81J4K9oml0s4xxFiO/mTc
RwwBnjDZQ7GZ+H435Ia+Ws8RBpEctZBHyHGLTjDM6DGqjGr3yPqjGxYyF4UmJqdC
0BQpeY2BUNqOARuU4uvWSergjEQjWqBK3o3T2tff+HnQfWwkDsgirg3g5HxThmW6
fPI/Z00luYK+b34e6gJ3JgDRTuy31eA2LZ2gjVaPoQKBgQDyTpUMPVk4VHKfXoCR
2YmMhOoZGUUHBoO/9fDmb99MqqJfFIRFbgR03L22+tXSjBAUMdijCl4jG6KBPHOQ
5klC7wrw1EKHYtqvJvwvlthBkvuWioTe+tqwUTPuEm+XxpZoKZdL+XHGMzsRF/4E
bpa1LQmoTS7qkyzUKdhKPA2quwKBgQDHlK6TGWu3HD5pzxglHtO7ObQo9/SU1cpi
MqEy/Vyy33fyqVberCd1e3JYcuj7ZeOPTest0TjNmIlBOifU53y0Tt3A+szHXeI0
1vwbZlWytttuscblA9PHmpsJbLjI1WvcQesM2uqU3aiVmizBzcFmczVyZrn+8Sbg
V6vLrm35jQKBgQDZ7lOf7o2QXGO7cwOwKjfMar8iU9gBuZpFzK4elAACtHXVjl5p
E8puURtQt8oY1GChyTNPcMO6T+CY3AYVDQpXaSgt8rrjicWmQyoOo11dnRUrEOrw
oi6O5noOZgZ4O+SLSt0JOBFccjdt6GZPFif2S8uj08ees0BekkQ2gEzKgQKBgF/B
wpDpXXkZoAh8SIVm6Qeng/00GrFech/zUsx4K4XXGmHfRcLIrpX7iL1PROF53Vjg
dboh7DMYwKH/GSVZe8e3H0Z8DsyJCwN3MraivvNkMJxHx7oRwAbA8ynudCpH29xt
9CzSzEJop34/3sGNywEwvbAKAauEYLa62b58Dl/xAoGBAIohyO5pZ1DuIooGELOl
D6hYurhmniwZupS5KDXZ6QoZ4sPoiBZdOSo80ah85T4G7zGPUucsNieAso5vhhu/
ADbQ79ZIbR2jFPwrVbMyiqU+k2/QeIKCy59DuWdrzoARhWmCOU1y++WOXF4T6esG
YDYcPhQDviyhrmfljUVw0OSk
-----END PRIVATE KEY-----
";
    const RSA_PKCS1: &str = "\
-----BEGIN RSA PRIVATE KEY-----
MIIEpAIBAAKCAQEAvOfQh1NBWs96w3tTfN0/zopn/7pr7ebEguL68CAtVliC/90l
ZCITuwGjWH/bvwVl8u7zE4eaGC/fNwJYNQNKbKBLIzkKBv530nE40OYRxs8SBB8/
2ZycpKQtOG+LtVzdGQKQFHG9wVtIvQFlSf26x+oygyTpDvQHmV2mmmyknTqVjt3D
JLerF4qzAFFiduU+4nr9Ar6hipdg7xiOVl8jF22HI6UQFk4rqAtQrxuF9SI13d1C
4VkId8qX81Os//4a2N5imaHOlQv51BcRPna94mBr0UbEtEFD1Po5E+YtkQ3SCEne
Z0L6nVaPB5OnBcmy8wlMzBleSqaAR3xyKjXr/wIDAQABAoIBAAqH/rJ/2OjjIDwk
DlqrsV7zJsRO9Eb/0nzDHEVx+Pt5u8CstEtWZJsyuce5RdrqxiA6ltQqS+24dxoH
lQgZKUQ2oeAfOFV9FXKZ9Um2fQJqxBDB9tR+5dl+SmpKOnoStapeeWg3K+KXrQDW
DxUgHBJnfNSeCvaJpdLOMcRYjv5k3EcMAZ4w2UOxmfh+N+SGvlrPEQaRHLWQR8hx
i04wzOgxqoxq98j6oxsWMheFJianQtAUKXmNgVDajgEblOLr1knq4IxEI1qgSt6N
09rX3/h50H1sJA7IIq4N4OR8U4ZlunzyP2dNJbmCvm9+HuoCdyYA0U7st9XgNi2d
oI1Wj6ECgYEA8k6VDD1ZOFRyn16AkdmJjITqGRlFBwaDv/Xw5m/fTKqiXxSERW4E
dNy9tvrV0owQFDHYowpeIxuigTxzkOZJQu8K8NRCh2Laryb8L5bYQZL7loqE3vra
sFEz7hJvl8aWaCmXS/lxxjM7ERf+BG6WtS0JqE0u6pMs1CnYSjwNqrsCgYEAx5Su
kxlrtxw+ac8YJR7Tuzm0KPf0lNXKYjKhMv1cst938qlW3qwndXtyWHLo+2Xjj03r
LdE4zZiJQTon1Od8tE7dwPrMx13iNNb8G2ZVsrbbbrHG5QPTx5qbCWy4yNVr3EHr
DNrqlN2olZoswc3BZnM1cma5/vEm4Fery65t+Y0CgYEA2e5Tn+6NkFxju3MDsCo3
zGq/IlPYAbmaRcyuHpQAArR11Y5eaRPKblEbULfKGNRgockzT3DDuk/gmNwGFQ0K
V2koLfK644nFpkMqDqNdXZ0VKxDq8KIujuZ6DmYGeDvki0rdCTgRXHI3behmTxYn
9kvLo9PHnrNAXpJENoBMyoECgYBfwcKQ6V15GaAIfEiFZukHp4P9NBqxXnIf81LM
eCuF1xph30XCyK6V+4i9T0Thed1Y4HW6IewzGMCh/xklWXvHtx9GfA7MiQsDdzK2
or7zZDCcR8e6EcAGwPMp7nQqR9vcbfQs0sxCaKd+P97BjcsBML2wCgGrhGC2utm+
fA5f8QKBgQCKIcjuaWdQ7iKKBhCzpQ+oWLq4Zp4sGbqUuSg12ekKGeLD6IgWXTkq
PNGofOU+Bu8xj1LnLDYngLKOb4YbvwA20O/WSG0doxT8K1WzMoqlPpNv0HiCgsuf
Q7lna86AEYVpgjlNcvvljlxeE+nrBmA2HD4UA74soa5n5Y1FcNDkpA==
-----END RSA PRIVATE KEY-----
";
    const EC_SEC1: &str = "\
-----BEGIN EC PRIVATE KEY-----
MHcCAQEEIAsrlIKo+Pr7ImQpY7iSE4RdIjZja6n+kV0VCpg9dQK8oAoGCCqGSM49
AwEHoUQDQgAEPizSdS1uk6u2NVarvLnUalwrOBRfsrDs3i/rZzp6298ZW5jsiobV
57w7PQCAxlkg3TZ+W0Hu1sicc/u7TVgKqQ==
-----END EC PRIVATE KEY-----
";
    const EC_PKCS8: &str = "\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgCyuUgqj4+vsiZClj
uJIThF0iNmNrqf6RXRUKmD11AryhRANCAAQ+LNJ1LW6Tq7Y1Vqu8udRqXCs4FF+y
sOzeL+tnOnrb3xlbmOyKhtXnvDs9AIDGWSDdNn5bQe7WyJxz+7tNWAqp
-----END PRIVATE KEY-----
";

    /// A directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let name = format!(
                "tollgate-tls-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let path = std::env::temp_dir().join(name);
            fs::create_dir_all(&path).expect("create temp dir");
            Self(path)
        }

        fn write(&self, name: &str, contents: &str) -> PathBuf {
            let path = self.0.join(name);
            fs::write(&path, contents).expect("write temp file");
            path
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// A private CA issuing leaf certificates into a temp dir.
    struct Pki {
        dir: TempDir,
        ca: rcgen::Certificate,
        ca_key: KeyPair,
    }

    impl Pki {
        fn new() -> Self {
            let ca_key = KeyPair::generate().expect("CA key");
            let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, "tollgate test CA");
            let ca = params.self_signed(&ca_key).expect("CA cert");
            Self {
                dir: TempDir::new(),
                ca,
                ca_key,
            }
        }

        fn ca_file(&self) -> PathBuf {
            self.dir.write("ca.pem", &self.ca.pem())
        }

        /// Issues a certificate for `names` with a fresh EC key (PKCS#8), stored as
        /// `<stem>.pem` / `<stem>.key`.
        fn issue(&self, stem: &str, names: &[&str]) -> (CertConfig, CertificateDer<'static>) {
            let key = KeyPair::generate().expect("leaf key");
            self.issue_with(stem, leaf_params(names), &key, &key.serialize_pem())
        }

        /// Signs `params` for `key` and stores the chain (leaf, CA) and `key_pem`.
        fn issue_with(
            &self,
            stem: &str,
            params: CertificateParams,
            key: &KeyPair,
            key_pem: &str,
        ) -> (CertConfig, CertificateDer<'static>) {
            let leaf = params
                .signed_by(key, &self.ca, &self.ca_key)
                .expect("sign leaf");
            let chain = format!("{}{}", leaf.pem(), self.ca.pem());
            let cert = CertConfig {
                cert: self.dir.write(&format!("{stem}.pem"), &chain),
                key: self.dir.write(&format!("{stem}.key"), key_pem),
            };
            (cert, leaf.der().clone())
        }

        /// A client that trusts only this CA.
        fn client(&self, alpn: &[&[u8]]) -> ClientConfig {
            let mut roots = RootCertStore::empty();
            roots.add(self.ca.der().clone()).expect("add CA");
            let mut config = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(PROTOCOL_VERSIONS)
                .expect("versions")
                .with_root_certificates(roots)
                .with_no_client_auth();
            config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            config
        }
    }

    fn leaf_params(names: &[&str]) -> CertificateParams {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        CertificateParams::new(names).expect("leaf params")
    }

    fn any_cert_client(sni: bool) -> ClientConfig {
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(PROTOCOL_VERSIONS)
            .expect("versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(SignaturesOnly(provider())))
            .with_no_client_auth();
        config.enable_sni = sni;
        config
    }

    /// What the client saw of a completed handshake.
    #[derive(Debug)]
    struct Seen {
        leaf: CertificateDer<'static>,
        alpn: Option<Vec<u8>>,
        version: Option<ProtocolVersion>,
    }

    /// Runs client and server over an in-memory pipe, then sends one message through the
    /// session to prove it works.
    async fn handshake(
        server: Arc<ServerConfig>,
        client: ClientConfig,
        name: &str,
    ) -> Result<Seen, io::Error> {
        let name = ServerName::try_from(name.to_owned()).expect("test server name");
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let run = async {
            let (server_side, client_side) = tokio::join!(
                TlsAcceptor::from(server).accept(server_io),
                TlsConnector::from(Arc::new(client)).connect(name, client_io)
            );
            let mut client_side = client_side?;
            let mut server_side = server_side?;
            client_side.write_all(b"ping").await?;
            client_side.flush().await?;
            let mut buf = [0u8; 4];
            server_side.read_exact(&mut buf).await?;
            assert_eq!(&buf, b"ping");
            let conn = client_side.get_ref().1;
            Ok(Seen {
                leaf: conn.peer_certificates().expect("peer certificates")[0].clone(),
                alpn: conn.alpn_protocol().map(<[u8]>::to_vec),
                version: conn.protocol_version(),
            })
        };
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("handshake timed out")
    }

    #[tokio::test]
    async fn sni_picks_the_certificate_whose_names_match() {
        let pki = Pki::new();
        let (a, a_der) = pki.issue("a", &["a.test"]);
        let (b, b_der) = pki.issue("b", &["b.test", "www.b.test"]);
        let server = server_config(&[a, b]).expect("server config");

        for (name, want) in [
            ("a.test", &a_der),
            ("b.test", &b_der),
            ("www.b.test", &b_der),
        ] {
            let seen = handshake(server.clone(), pki.client(&[]), name)
                .await
                .unwrap_or_else(|e| panic!("handshake for {name}: {e}"));
            assert_eq!(&seen.leaf, want, "certificate for {name}");
        }
        // SNI is case-insensitive (RFC 6066 section 3 / RFC 4343).
        let seen = handshake(server, pki.client(&[]), "B.TEST")
            .await
            .expect("handshake");
        assert_eq!(seen.leaf, b_der);
    }

    #[tokio::test]
    async fn wildcard_covers_exactly_one_label() {
        let pki = Pki::new();
        let (first, first_der) = pki.issue("first", &["first.test"]);
        let (wild, wild_der) = pki.issue("wild", &["*.wild.test"]);
        let server = server_config(&[first, wild]).expect("server config");

        for (name, want) in [
            ("api.wild.test", &wild_der),
            ("wild.test", &first_der),
            ("deep.api.wild.test", &first_der),
        ] {
            let seen = handshake(server.clone(), any_cert_client(true), name)
                .await
                .expect("handshake");
            assert_eq!(&seen.leaf, want, "certificate for {name}");
        }
    }

    #[tokio::test]
    async fn without_sni_or_match_the_first_certificate_is_served() {
        let pki = Pki::new();
        let (a, a_der) = pki.issue("a", &["a.test"]);
        let (b, b_der) = pki.issue("b", &["b.test"]);

        let a_first = server_config(&[a.clone(), b.clone()]).expect("server config");
        let b_first = server_config(&[b, a]).expect("server config");
        for (server, want) in [(a_first, &a_der), (b_first, &b_der)] {
            // No SNI at all: the client still verifies against its own idea of the name.
            let seen = handshake(server.clone(), any_cert_client(false), "b.test")
                .await
                .expect("handshake without SNI");
            assert_eq!(&seen.leaf, want);
            // SNI naming no configured certificate.
            let seen = handshake(server, any_cert_client(true), "other.test")
                .await
                .expect("handshake with unknown SNI");
            assert_eq!(&seen.leaf, want);
        }
    }

    #[tokio::test]
    async fn alpn_prefers_h2_and_falls_back_to_http11() {
        let pki = Pki::new();
        let (a, _) = pki.issue("a", &["a.test"]);
        let server = server_config(&[a]).expect("server config");

        for (offer, want) in [
            (&[b"h2".as_slice(), b"http/1.1"][..], Some(b"h2".to_vec())),
            (&[b"http/1.1".as_slice(), b"h2"][..], Some(b"h2".to_vec())),
            (&[b"http/1.1".as_slice()][..], Some(b"http/1.1".to_vec())),
            (&[][..], None),
        ] {
            let seen = handshake(server.clone(), pki.client(offer), "a.test")
                .await
                .expect("handshake");
            assert_eq!(seen.alpn, want, "client offered {offer:?}");
        }
    }

    #[tokio::test]
    async fn only_tls12_and_tls13_are_enabled() {
        let mut versions: Vec<ProtocolVersion> =
            PROTOCOL_VERSIONS.iter().map(|v| v.version).collect();
        versions.sort_by_key(|v| u16::from(*v));
        assert_eq!(
            versions,
            [ProtocolVersion::TLSv1_2, ProtocolVersion::TLSv1_3]
        );

        let pki = Pki::new();
        let (a, _) = pki.issue("a", &["a.test"]);
        let server = server_config(&[a]).expect("server config");
        for version in [&TLS12, &TLS13] {
            let mut roots = RootCertStore::empty();
            roots.add(pki.ca.der().clone()).expect("add CA");
            let client = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(&[version])
                .expect("version")
                .with_root_certificates(roots)
                .with_no_client_auth();
            let seen = handshake(server.clone(), client, "a.test")
                .await
                .expect("handshake");
            assert_eq!(seen.version, Some(version.version));
        }
    }

    /// rustls clients cannot offer TLS 1.1, so this uses the openssl command line when it is
    /// installed. Lowering openssl's security level lets it actually send a TLS 1.1
    /// ClientHello (OpenSSL 3 refuses to otherwise), and the server side must fail.
    #[tokio::test]
    async fn tls11_client_is_refused() {
        let available = std::process::Command::new("openssl")
            .arg("version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !available {
            println!("NOTE: openssl not installed; skipping the TLS 1.1 wire check");
            return;
        }

        let pki = Pki::new();
        let (a, _) = pki.issue("a", &["a.test"]);
        let acceptor = TlsAcceptor::from(server_config(&[a]).expect("server config"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");

        // TLS 1.2 first, as a control: the harness itself must be able to succeed.
        for (flag, should_succeed) in [("-tls1_2", true), ("-tls1_1", false)] {
            let server = async {
                let (tcp, _) = listener.accept().await?;
                let mut tls = acceptor.accept(tcp).await?;
                // Stay until openssl closes (it does at the end of its stdin), so that it
                // does not see an unexpected EOF.
                let mut rest = Vec::new();
                let _ = tls.read_to_end(&mut rest).await;
                Ok::<_, io::Error>(())
            };
            let client = tokio::process::Command::new("openssl")
                .args(["s_client", "-connect", &addr.to_string()])
                .args([
                    "-servername",
                    "a.test",
                    flag,
                    "-cipher",
                    "DEFAULT@SECLEVEL=0",
                ])
                .env("OPENSSL_CONF", "/dev/null")
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output();
            let (server, client) = tokio::time::timeout(Duration::from_secs(20), async {
                tokio::join!(server, client)
            })
            .await
            .expect("openssl handshake timed out");
            let client = client.expect("run openssl");
            match &server {
                Ok(()) => assert!(should_succeed, "server accepted {flag}"),
                // The ClientHello arrived and rustls refused it (a TLS 1.1 hello carries
                // nothing a TLS 1.2+ server can agree to), rather than openssl giving up
                // before sending anything.
                Err(e) => assert!(
                    !should_succeed
                        && matches!(
                            e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()),
                            Some(rustls::Error::PeerIncompatible(_))
                        ),
                    "server with {flag}: {e:?}"
                ),
            }
            assert_eq!(
                client.status.success(),
                should_succeed,
                "openssl with {flag}: {}",
                String::from_utf8_lossy(&client.stderr)
            );
        }
    }

    #[test]
    fn pkcs8_pkcs1_and_sec1_keys_load() {
        let pki = Pki::new();
        let (pkcs8, _) = pki.issue("pkcs8", &["a.test"]);
        load_certified_key(&pkcs8).expect("PKCS#8 key");

        let rsa = KeyPair::from_pkcs8_pem_and_sign_algo(RSA_PKCS8, &rcgen::PKCS_RSA_SHA256)
            .expect("RSA key");
        let (pkcs1, _) = pki.issue_with("pkcs1", leaf_params(&["rsa.test"]), &rsa, RSA_PKCS1);
        load_certified_key(&pkcs1).expect("PKCS#1 key");

        let ec = KeyPair::from_pem(EC_PKCS8).expect("EC key");
        let (sec1, _) = pki.issue_with("sec1", leaf_params(&["ec.test"]), &ec, EC_SEC1);
        load_certified_key(&sec1).expect("SEC1 key");
    }

    #[tokio::test]
    async fn pkcs1_and_sec1_keys_sign_handshakes() {
        let pki = Pki::new();
        let rsa = KeyPair::from_pkcs8_pem_and_sign_algo(RSA_PKCS8, &rcgen::PKCS_RSA_SHA256)
            .expect("RSA key");
        let (pkcs1, pkcs1_der) =
            pki.issue_with("pkcs1", leaf_params(&["rsa.test"]), &rsa, RSA_PKCS1);
        let ec = KeyPair::from_pem(EC_PKCS8).expect("EC key");
        let (sec1, sec1_der) = pki.issue_with("sec1", leaf_params(&["ec.test"]), &ec, EC_SEC1);
        let server = server_config(&[pkcs1, sec1]).expect("server config");

        for (name, want) in [("rsa.test", &pkcs1_der), ("ec.test", &sec1_der)] {
            for version in [&TLS12, &TLS13] {
                let mut roots = RootCertStore::empty();
                roots.add(pki.ca.der().clone()).expect("add CA");
                let client = ClientConfig::builder_with_provider(provider())
                    .with_protocol_versions(&[version])
                    .expect("version")
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                let seen = handshake(server.clone(), client, name)
                    .await
                    .unwrap_or_else(|e| panic!("{name} {:?}: {e}", version.version));
                assert_eq!(&seen.leaf, want);
            }
        }
    }

    #[test]
    fn key_of_another_certificate_is_refused() {
        let pki = Pki::new();
        let (a, _) = pki.issue("a", &["a.test"]);
        let (b, _) = pki.issue("b", &["b.test"]);
        let mixed = CertConfig {
            cert: a.cert.clone(),
            key: b.key.clone(),
        };
        let err = load_certified_key(&mixed).expect_err("mismatched key");
        assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&*a.cert.to_string_lossy()), "{msg}");
        assert!(msg.contains(&*b.key.to_string_lossy()), "{msg}");

        // The chain in the wrong order (CA first) is the same mistake, with a hint.
        let pem = fs::read_to_string(&a.cert).expect("read chain");
        let split = pem.find("-----END CERTIFICATE-----").expect("leaf end") + 26;
        let reversed = format!("{}{}", &pem[split..], &pem[..split]);
        let swapped = CertConfig {
            cert: pki.dir.write("reversed.pem", &reversed),
            key: a.key.clone(),
        };
        let err = load_certified_key(&swapped).expect_err("CA first");
        assert!(
            err.to_string().contains("leaf certificate must come first"),
            "{err}"
        );
    }

    #[test]
    fn expired_and_not_yet_valid_certificates_are_refused() {
        let pki = Pki::new();
        let key = KeyPair::generate().expect("key");

        let mut params = leaf_params(&["old.test"]);
        params.not_before = rcgen::date_time_ymd(2019, 1, 1);
        params.not_after = rcgen::date_time_ymd(2020, 1, 1);
        let (old, _) = pki.issue_with("old", params, &key, &key.serialize_pem());
        let err = load_certified_key(&old).expect_err("expired");
        assert!(matches!(err, TlsError::Expired { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&*old.cert.to_string_lossy()), "{msg}");
        assert!(msg.contains("2020-01-01T00:00:00Z"), "{msg}");

        let mut params = leaf_params(&["future.test"]);
        params.not_before = rcgen::date_time_ymd(2999, 1, 1);
        let (future, _) = pki.issue_with("future", params, &key, &key.serialize_pem());
        let err = load_certified_key(&future).expect_err("not yet valid");
        assert!(matches!(err, TlsError::NotYetValid { .. }), "{err:?}");
        assert!(err.to_string().contains("2999-01-01T00:00:00Z"), "{err}");

        // The bounds themselves are inside the validity period.
        let mut params = leaf_params(&["edge.test"]);
        params.not_before = rcgen::date_time_ymd(2019, 1, 1);
        params.not_after = rcgen::date_time_ymd(2020, 1, 1);
        let (edge, _) = pki.issue_with("edge", params, &key, &key.serialize_pem());
        let not_after = 1_577_836_800; // 2020-01-01T00:00:00Z
        load_certified_key_at(&edge, not_after).expect("valid at notAfter");
        let not_before = 1_546_300_800; // 2019-01-01T00:00:00Z
        load_certified_key_at(&edge, not_before).expect("valid at notBefore");
        assert!(load_certified_key_at(&edge, not_before - 1).is_err());
        assert!(load_certified_key_at(&edge, not_after + 1).is_err());
    }

    #[test]
    fn missing_files_are_named() {
        let pki = Pki::new();
        let (a, _) = pki.issue("a", &["a.test"]);
        let missing = pki.dir.0.join("missing.pem");

        for cert in [
            CertConfig {
                cert: missing.clone(),
                key: a.key.clone(),
            },
            CertConfig {
                cert: a.cert.clone(),
                key: missing.clone(),
            },
        ] {
            let err = load_certified_key(&cert).expect_err("missing file");
            assert!(matches!(err, TlsError::Read { .. }), "{err:?}");
            assert!(
                err.to_string().contains(&*missing.to_string_lossy()),
                "{err}"
            );
        }
        let err = server_config(&[CertConfig {
            cert: missing.clone(),
            key: a.key,
        }])
        .expect_err("missing file");
        assert!(
            err.to_string().contains(&*missing.to_string_lossy()),
            "{err}"
        );
    }

    #[test]
    fn pem_files_with_the_wrong_contents_are_refused() {
        let pki = Pki::new();
        let (a, _) = pki.issue("a", &["a.test"]);
        let key_pem = fs::read_to_string(&a.key).expect("read key");
        let cert_pem = fs::read_to_string(&a.cert).expect("read cert");
        let with = |cert: &str, key: &str| CertConfig {
            cert: pki.dir.write("case.pem", cert),
            key: pki.dir.write("case.key", key),
        };

        let err = load_certified_key(&with(&key_pem, &key_pem)).expect_err("key as cert");
        assert!(matches!(err, TlsError::NoCertificate { .. }), "{err:?}");
        assert!(err.to_string().contains("case.pem"), "{err}");

        let err = load_certified_key(&with(&cert_pem, &cert_pem)).expect_err("cert as key");
        assert!(matches!(err, TlsError::NoPrivateKey { .. }), "{err:?}");
        assert!(err.to_string().contains("case.key"), "{err}");

        let two_keys = format!("{key_pem}{EC_PKCS8}");
        let err = load_certified_key(&with(&cert_pem, &two_keys)).expect_err("two keys");
        assert!(
            matches!(err, TlsError::SeveralPrivateKeys { count: 2, .. }),
            "{err:?}"
        );

        let encrypted =
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n";
        let err = load_certified_key(&with(&cert_pem, encrypted)).expect_err("encrypted");
        assert!(
            matches!(err, TlsError::EncryptedPrivateKey { .. }),
            "{err:?}"
        );

        let garbage = "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n";
        let err = load_certified_key(&with(garbage, &key_pem)).expect_err("bad base64");
        assert!(matches!(err, TlsError::Pem { .. }), "{err:?}");

        let not_der = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let err = load_certified_key(&with(not_der, &key_pem)).expect_err("not a certificate");
        assert!(matches!(err, TlsError::BadCertificate { .. }), "{err:?}");

        // A combined file (chain and key together) works for both fields.
        let combined = format!("{cert_pem}{key_pem}");
        load_certified_key(&with(&combined, &combined)).expect("combined PEM");

        assert!(matches!(server_config(&[]), Err(TlsError::NoCertificates)));
    }

    #[test]
    fn debug_and_errors_show_no_key_material() {
        let pki = Pki::new();
        let (a, _) = pki.issue("a", &["a.test"]);
        let resolver = SniResolver::load(std::slice::from_ref(&a)).expect("resolver");
        let debug = format!("{resolver:?}");
        assert!(debug.contains(&*a.cert.to_string_lossy()), "{debug}");
        assert!(!debug.contains("PRIVATE"), "{debug}");
        assert!(!debug.contains("key"), "{debug}");

        let (b, _) = pki.issue("b", &["b.test"]);
        let err = load_certified_key(&CertConfig {
            cert: a.cert,
            key: b.key.clone(),
        })
        .expect_err("mismatch");
        let key_pem = fs::read_to_string(&b.key).expect("read key");
        let body: String = key_pem
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        for text in [err.to_string(), format!("{err:?}")] {
            assert!(!text.contains(&body[..20]), "{text}");
        }
    }

    #[tokio::test]
    async fn client_config_trusts_the_private_ca_from_ca_file() {
        let pki = Pki::new();
        let (a, a_der) = pki.issue("a", &["a.test"]);
        let server = server_config(&[a]).expect("server config");
        let ca_file = pki.ca_file();

        let client = client_config(Some(&ca_file), false).expect("client config");
        let seen = handshake(server.clone(), (*client).clone(), "a.test")
            .await
            .expect("handshake trusting the CA");
        assert_eq!(seen.leaf, a_der);
        assert_eq!(seen.alpn.as_deref(), Some(&b"http/1.1"[..]));

        let client = client_config(Some(&ca_file), true).expect("client config");
        let seen = handshake(server.clone(), (*client).clone(), "a.test")
            .await
            .expect("handshake trusting the CA");
        assert_eq!(seen.alpn.as_deref(), Some(&b"h2"[..]));

        let client = client_config(None, false).expect("client config");
        let err = handshake(server, (*client).clone(), "a.test")
            .await
            .expect_err("private CA is not in webpki-roots");
        let inner = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>());
        assert!(
            matches!(
                inner,
                Some(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::UnknownIssuer
                ))
            ),
            "{err:?}"
        );
    }

    #[test]
    fn client_config_reports_bad_ca_files() {
        let dir = TempDir::new();
        let missing = dir.0.join("missing-ca.pem");
        let err = client_config(Some(&missing), false).expect_err("missing");
        assert!(matches!(err, TlsError::Read { .. }), "{err:?}");
        assert!(err.to_string().contains("missing-ca.pem"), "{err}");

        let no_certs = dir.write("empty-ca.pem", EC_PKCS8);
        let err = client_config(Some(&no_certs), false).expect_err("no certificate");
        assert!(matches!(err, TlsError::NoCertificate { .. }), "{err:?}");
        assert!(err.to_string().contains("empty-ca.pem"), "{err}");

        let bad = dir.write(
            "bad-ca.pem",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        );
        let err = client_config(Some(&bad), false).expect_err("not a certificate");
        assert!(matches!(err, TlsError::BadCaCertificate { .. }), "{err:?}");
    }

    #[test]
    fn validity_is_read_in_both_asn1_time_forms() {
        // RFC 5280 section 4.1.2.5: UTCTime through 2049 (two-digit years, 50..99 meaning
        // 19xx), GeneralizedTime from 2050; rcgen writes each date in the form it requires.
        let pki = Pki::new();
        let key = KeyPair::generate().expect("key");
        let read = |not_before, not_after| {
            let mut params = leaf_params(&["dates.test"]);
            params.not_before = not_before;
            params.not_after = not_after;
            let (_, der) = pki.issue_with("dates", params, &key, &key.serialize_pem());
            Validity::from_der(&der).expect("validity")
        };
        let second = std::time::Duration::from_secs(1);

        let v = read(
            rcgen::date_time_ymd(1950, 1, 1),
            rcgen::date_time_ymd(2050, 1, 1) - second,
        );
        assert_eq!(v.not_before.to_string(), "1950-01-01T00:00:00Z");
        assert_eq!(v.not_before.unix, -631_152_000);
        assert_eq!(v.not_after.to_string(), "2049-12-31T23:59:59Z");
        assert_eq!(v.not_after.unix, 2_524_607_999);

        let v = read(
            rcgen::date_time_ymd(2024, 2, 29) + 12 * 3600 * second,
            rcgen::date_time_ymd(2050, 1, 1),
        );
        assert_eq!(v.not_before.to_string(), "2024-02-29T12:00:00Z");
        assert_eq!(v.not_before.unix, 1_709_208_000);
        assert_eq!(v.not_after.to_string(), "2050-01-01T00:00:00Z");
        assert_eq!(v.not_after.unix, 2_524_608_000);

        // Truncating a real certificate anywhere never panics and never half-parses.
        let (_, der) = pki.issue("a", &["a.test"]);
        let validity = Validity::from_der(&der).expect("validity");
        assert_eq!(validity.not_before.to_string(), "1975-01-01T00:00:00Z");
        assert_eq!(validity.not_after.to_string(), "4096-01-01T00:00:00Z");
        for len in 0..der.len() {
            assert!(Validity::from_der(&der[..len]).is_err(), "{len} bytes");
        }
    }
}
