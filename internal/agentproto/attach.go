package agentproto

// AttachMarker begins every attach of a host to an agent that serves hosts
// one after another on its stdin (kiln-agent -await-host, on Kubernetes,
// where a second kiln replica takes over a box whose first replica died).
// On it the agent drops whatever an earlier host left half-written, stops
// answering that host's requests, and says hello again.
//
// It cannot occur inside a stream of frames: it begins with eight control
// bytes in a row, while a frame is a 4-byte length (at most MaxFrame, so
// its first byte is at most 4) followed by JSON, which never holds a raw
// control byte (encoding/json escapes them) and begins with '{'.
var AttachMarker = []byte("\x00\x01\x02\x03\x04\x05\x06\x07kiln-attach\x1f")
