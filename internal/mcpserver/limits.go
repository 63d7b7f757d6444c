package mcpserver

// Limits on what one client message can carry. Each is derived from the
// one before it so that none is unreachable: a files payload just over
// maxFilesBytes still fits in one message, as text or as base64 (4/3 of
// the bytes), so a client that sends too much is told about the files
// limit instead of hitting the message limit first. TestFilesLimitReachable
// holds the relation.
const (
	// maxMessageBytes bounds one inbound JSON-RPC message: a stdio line
	// (as the SDK's own stdio transport does) or an HTTP request body.
	maxMessageBytes = 16 << 20
	// maxFilesBytes bounds the decoded per-call files of one call.
	maxFilesBytes = maxMessageBytes / 2
)
