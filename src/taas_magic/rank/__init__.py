"""What runs inside a rank: its setup, the cell, a session's loop, the debugger, reports about itself."""
