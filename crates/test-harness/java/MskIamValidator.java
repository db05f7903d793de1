// The broker side of Amazon MSK's IAM authentication, for tests: a Kafka
// OAUTHBEARER validator that accepts a token only when it is a SigV4-presigned
// `kafka-cluster:Connect` URL for this region whose signature is right for a
// known secret key and whose time window holds. It recomputes the signature
// itself (SigV4 as AWS documents it), so it shares no code with the client.
//
// Secret keys come from the JAAS option `keys` ("AKID:SECRET,…", static
// keys) and, for keys it does not know, from an STS stand-in's state
// (`sts_state`, moto's /moto-api/data.json): MSK asks IAM the same question.
// Every decision is printed to the broker's stdout as one line
// ("msk-iam: accepted AKID signed 20261125T120000Z" / "msk-iam: refused:
// AKID: reason").
//
// JAAS options: region, keys, sts_state (optional).

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.InputStream;
import java.net.URI;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;
import javax.security.auth.callback.Callback;
import javax.security.auth.callback.UnsupportedCallbackException;
import javax.security.auth.login.AppConfigurationEntry;
import org.apache.kafka.common.security.auth.AuthenticateCallbackHandler;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerExtensionsValidatorCallback;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerToken;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallback;

public class MskIamValidator implements AuthenticateCallbackHandler {
    private static final DateTimeFormatter AMZ_DATE =
        DateTimeFormatter.ofPattern("yyyyMMdd'T'HHmmss'Z'").withZone(ZoneOffset.UTC);

    private final Map<String, String> secrets = new HashMap<>();
    private String region;
    private String stsState;

    @Override
    public void configure(Map<String, ?> configs, String mechanism, List<AppConfigurationEntry> jaas) {
        Map<String, ?> options = jaas.get(0).getOptions();
        region = (String) options.get("region");
        stsState = (String) options.get("sts_state");
        String keys = (String) options.get("keys");
        if (keys != null && !keys.isEmpty()) {
            for (String pair : keys.split(",")) {
                String[] kv = pair.split(":", 2);
                secrets.put(kv[0], kv[1]);
            }
        }
    }

    @Override
    public void close() {}

    @Override
    public void handle(Callback[] callbacks) throws UnsupportedCallbackException {
        for (Callback callback : callbacks) {
            if (callback instanceof OAuthBearerValidatorCallback v) {
                try {
                    OAuthBearerToken token = validate(v.tokenValue());
                    System.out.println("msk-iam: accepted " + token.principalName() + " signed "
                        + AMZ_DATE.format(java.time.Instant.ofEpochMilli(token.startTimeMs())));
                    v.token(token);
                } catch (Exception e) {
                    System.out.println("msk-iam: refused: " + e.getMessage());
                    v.error("invalid_token", null, null);
                }
                System.out.flush();
            } else if (callback instanceof OAuthBearerExtensionsValidatorCallback) {
                // No extensions are expected or used.
            } else {
                throw new UnsupportedCallbackException(callback);
            }
        }
    }

    private OAuthBearerToken validate(String token) throws Exception {
        String url = new String(Base64.getUrlDecoder().decode(token), StandardCharsets.UTF_8);
        String host = "kafka." + region + ".amazonaws.com";
        String prefix = "https://" + host + "/?";
        if (!url.startsWith(prefix)) {
            throw new Exception("not a presigned URL for " + host);
        }
        Map<String, String> params = new TreeMap<>();
        for (String pair : url.substring(prefix.length()).split("&")) {
            String[] kv = pair.split("=", 2);
            String key = URLDecoder.decode(kv[0], StandardCharsets.UTF_8);
            if (params.put(key, URLDecoder.decode(kv.length > 1 ? kv[1] : "", StandardCharsets.UTF_8)) != null) {
                throw new Exception("parameter " + key + " twice");
            }
        }
        expect(params, "Action", "kafka-cluster:Connect");
        expect(params, "X-Amz-Algorithm", "AWS4-HMAC-SHA256");
        expect(params, "X-Amz-SignedHeaders", "host");
        String[] credential = required(params, "X-Amz-Credential").split("/");
        if (credential.length != 5 || !credential[2].equals(region)
            || !credential[3].equals("kafka-cluster") || !credential[4].equals("aws4_request")) {
            throw new Exception("credential scope " + String.join("/", credential));
        }
        String accessKey = credential[0];
        String amzDate = required(params, "X-Amz-Date");
        Instant signed = Instant.from(AMZ_DATE.parse(amzDate));
        long expires = Long.parseLong(required(params, "X-Amz-Expires"));
        Instant now = Instant.now();
        if (expires > 900 || signed.plusSeconds(expires).isBefore(now) || signed.isAfter(now.plusSeconds(300))) {
            throw new Exception(accessKey + ": outside its validity (" + amzDate + ", " + expires + " s)");
        }
        if (!amzDate.startsWith(credential[1])) {
            throw new Exception(accessKey + ": the scope's date is not the signing date");
        }
        String[] secret = secretOf(accessKey);
        if (secret == null) {
            throw new Exception(accessKey + ": unknown access key");
        }
        String sessionToken = params.get("X-Amz-Security-Token");
        if (secret[1] != null && !secret[1].equals(sessionToken)) {
            throw new Exception(accessKey + ": not the session token STS issued");
        }
        // The canonical request: every parameter but the signature and the
        // User-Agent (added after signing), sorted, RFC 3986-encoded.
        List<String> query = new ArrayList<>();
        for (Map.Entry<String, String> e : params.entrySet()) {
            if (!e.getKey().equals("X-Amz-Signature") && !e.getKey().equals("User-Agent")) {
                query.add(encode(e.getKey()) + "=" + encode(e.getValue()));
            }
        }
        String canonical = "GET\n/\n" + String.join("&", query) + "\nhost:" + host + "\n\nhost\n" + hex(sha256(""));
        String scope = credential[1] + "/" + region + "/kafka-cluster/aws4_request";
        String toSign = "AWS4-HMAC-SHA256\n" + amzDate + "\n" + scope + "\n" + hex(sha256(canonical));
        byte[] key = hmac(("AWS4" + secret[0]).getBytes(StandardCharsets.UTF_8), credential[1]);
        key = hmac(key, region);
        key = hmac(key, "kafka-cluster");
        key = hmac(key, "aws4_request");
        String expected = hex(hmac(key, toSign));
        if (!MessageDigest.isEqual(expected.getBytes(StandardCharsets.UTF_8),
                required(params, "X-Amz-Signature").getBytes(StandardCharsets.UTF_8))) {
            throw new Exception(accessKey + ": the signature does not match");
        }
        long start = signed.toEpochMilli();
        long lifetime = signed.plusSeconds(expires).toEpochMilli();
        return new OAuthBearerToken() {
            public String value() { return token; }
            public Set<String> scope() { return Set.of(); }
            public long lifetimeMs() { return lifetime; }
            public String principalName() { return accessKey; }
            public Long startTimeMs() { return start; }
        };
    }

    /// The secret key of `accessKey` and the session token it needs (null:
    /// none), from the static keys or the STS stand-in's state.
    private String[] secretOf(String accessKey) throws Exception {
        String secret = secrets.get(accessKey);
        if (secret != null) {
            return new String[] {secret, null};
        }
        if (stsState == null) {
            return null;
        }
        try (InputStream in = URI.create(stsState).toURL().openStream()) {
            JsonNode roles = new ObjectMapper().readTree(in).path("sts").path("AssumedRole");
            for (JsonNode role : roles) {
                if (accessKey.equals(role.path("access_key_id").asText())) {
                    return new String[] {role.path("secret_access_key").asText(), role.path("session_token").asText()};
                }
            }
        }
        return null;
    }

    private static void expect(Map<String, String> params, String key, String value) throws Exception {
        if (!value.equals(params.get(key))) {
            throw new Exception(key + " is " + params.get(key) + ", not " + value);
        }
    }

    private static String required(Map<String, String> params, String key) throws Exception {
        String v = params.get(key);
        if (v == null) {
            throw new Exception("no " + key);
        }
        return v;
    }

    private static String encode(String s) {
        StringBuilder out = new StringBuilder();
        for (byte b : s.getBytes(StandardCharsets.UTF_8)) {
            char c = (char) (b & 0xff);
            if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')
                || c == '-' || c == '_' || c == '.' || c == '~') {
                out.append(c);
            } else {
                out.append(String.format("%%%02X", b & 0xff));
            }
        }
        return out.toString();
    }

    private static byte[] sha256(String s) throws Exception {
        return MessageDigest.getInstance("SHA-256").digest(s.getBytes(StandardCharsets.UTF_8));
    }

    private static byte[] hmac(byte[] key, String data) throws Exception {
        Mac mac = Mac.getInstance("HmacSHA256");
        mac.init(new SecretKeySpec(key, "HmacSHA256"));
        return mac.doFinal(data.getBytes(StandardCharsets.UTF_8));
    }

    private static String hex(byte[] bytes) {
        StringBuilder out = new StringBuilder();
        for (byte b : bytes) {
            out.append(String.format("%02x", b & 0xff));
        }
        return out.toString();
    }
}
