"""What every package needs and none owns: the errors that become exit codes, the types of
command-line arguments, and the process plumbing that keeps a child from outliving the
harness. It imports none of skiplock's other packages, so all of them may import it."""
