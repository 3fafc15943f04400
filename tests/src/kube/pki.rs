//! Throwaway certificates for one environment: a CA (whose key kube-controller-manager signs
//! kubelet certificates with), serving certificates for the apiserver, kube-controller-manager,
//! kube-scheduler and the Cluster API webhook server (valid for 127.0.0.1 and localhost; the apiserver's also
//! for the address VMs reach it at), the admin client certificate (O=system:masters) and the
//! service-account signing key.

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A PEM certificate and its PKCS#8 PEM key.
pub struct CertKey {
    pub cert_pem: String,
    pub key_pem: String,
}

pub struct Pki {
    ca_pem: String,
    ca_key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    pub fn new() -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "siteboot-test-ca");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate()?;
        let ca_pem = params.self_signed(&key)?.pem();
        let ca_key_pem = key.serialize_pem();
        Ok(Self { ca_pem, ca_key_pem, issuer: Issuer::new(params, key) })
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The CA's PKCS#8 key, for kube-controller-manager's CSR signer.
    pub fn ca_key_pem(&self) -> &str {
        &self.ca_key_pem
    }

    /// A serving certificate for loopback (`127.0.0.1`, `::1`, `localhost`) and `also`.
    pub fn server(&self, common_name: &str, also: &[&str]) -> Result<CertKey> {
        let names = ["127.0.0.1", "::1", "localhost"].iter().chain(also);
        let names = names.map(|name| (*name).to_owned()).collect();
        self.leaf(common_name, None, names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate; Kubernetes takes the user from CN and the groups from O.
    pub fn client(&self, user: &str, group: &str) -> Result<CertKey> {
        self.leaf(user, Some(group), Vec::new(), ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn leaf(
        &self,
        common_name: &str,
        organization: Option<&str>,
        names: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<CertKey> {
        let mut params = CertificateParams::new(names)?;
        params.distinguished_name.push(DnType::CommonName, common_name);
        if let Some(organization) = organization {
            params.distinguished_name.push(DnType::OrganizationName, organization);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![usage];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(CertKey { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }
}

/// An ECDSA P-256 key for signing service-account tokens: (PKCS#8 private key, SPKI public key),
/// PEM. The apiserver reads the public half from a separate file: it does not take it from PKCS#8.
pub fn service_account_key() -> Result<(String, String)> {
    let key = KeyPair::generate()?;
    Ok((key.serialize_pem(), key.public_key_pem()))
}
