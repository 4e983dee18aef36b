//! A source's signature check, built from its config. The schemes themselves (verifying and
//! signing, and the header names) live in `webhook`, which knows nothing of the config.

use crate::config::{SignatureScheme, SourceConfig};
use crate::webhook::{Verifier, decode_whsec};

impl Verifier {
    /// Builds the verifier of a validated source config.
    pub fn from_config(source: &SourceConfig) -> Result<Verifier, String> {
        let raw = || {
            source
                .secrets
                .iter()
                .map(|s| s.as_bytes().to_vec())
                .collect()
        };
        let tolerance_secs = i64::try_from(source.tolerance_secs).unwrap_or(i64::MAX);
        Ok(match source.signature {
            SignatureScheme::None => Verifier::None,
            SignatureScheme::Payzu => Verifier::Payzu {
                secrets: raw(),
                tolerance_secs,
            },
            SignatureScheme::StandardWebhooks => Verifier::StandardWebhooks {
                secrets: source
                    .secrets
                    .iter()
                    .map(|s| decode_whsec(s))
                    .collect::<Result<_, _>>()?,
                tolerance_secs,
            },
            SignatureScheme::HmacSha256 => Verifier::HmacSha256 {
                secrets: raw(),
                header: source
                    .signature_header
                    .as_deref()
                    .ok_or("signature_header is required")?
                    .parse()
                    .map_err(|_| "signature_header is not a header name")?,
            },
        })
    }
}
