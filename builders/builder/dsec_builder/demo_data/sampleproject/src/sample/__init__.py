def main():
    """Entry point for the application script"""
    print("Call your main application code here")
