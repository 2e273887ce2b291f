"""What crosses between processes: the channel, the messages, shipped names, results, memory files."""
