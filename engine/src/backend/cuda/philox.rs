//! Philox4x32-10 on the host, the generator of kernels/dropout.cu written the same way: the
//! reference a GPU test compares dropout masks with (bit for bit), and the one place the
//! generator is checked against the published known answers without a GPU.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Ten rounds of Philox4x32 on counter `c` under key (k0, k1).
pub fn philox4x32_10(mut c: [u32; 4], mut k0: u32, mut k1: u32) -> [u32; 4] {
    for _ in 0..10 {
        let p0 = M0 as u64 * c[0] as u64;
        let p1 = M1 as u64 * c[2] as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0];
        k0 = k0.wrapping_add(W0);
        k1 = k1.wrapping_add(W1);
    }
    c
}

/// The keep decision of element `i` of a dropout launch (dropout.cu: counter offset + i / 4
/// under key `seed`, lane i % 4, uniform from the top 24 bits, keep when >= ratio).
pub fn dropout_keep(seed: u64, offset: u64, i: u64, ratio: f32) -> bool {
    let c = offset.wrapping_add(i / 4);
    let r = philox4x32_10([c as u32, (c >> 32) as u32, 0, 0], seed as u32, (seed >> 32) as u32);
    let u = (r[(i % 4) as usize] >> 8) as f32 * (1.0 / 16_777_216.0);
    u >= ratio
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's kat_vectors for philox4x32 with 10 rounds.
    #[test]
    fn known_answers() {
        assert_eq!(philox4x32_10([0; 4], 0, 0), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], u32::MAX, u32::MAX), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], 0xa4093822, 0x299f31d0),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn keep_rate_is_one_minus_ratio() {
        let n = 100_000u64;
        let kept = (0..n).filter(|&i| dropout_keep(42, 7, i, 0.2)).count() as f64 / n as f64;
        // 4 sigma of a binomial(1e5, 0.8) proportion is 0.005
        assert!((kept - 0.8).abs() < 0.005, "{kept}");
        assert!((0..64).all(|i| dropout_keep(1, 0, i, 0.0)));
    }
}
